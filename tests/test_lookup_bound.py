"""The hindsight bound's arithmetic (benchmarks/lookup_bound.py): its dynamic program finds the least
decode time among every sequence of rounds, checked against brute force, and its calibrated planner
bets only where the expected tokens pay for the wider forward."""

import importlib.util
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lb():
    spec = importlib.util.spec_from_file_location("lookup_bound", ROOT / "benchmarks/lookup_bound.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def brute_force(chains, f, cached):
    """Every choice of k at every round, enumerated: the least total time."""
    n = len(chains)

    def best_from(i):
        if i >= n:
            return 0.0
        length, acc = chains[i][:2]
        return min(f(k + 1, cached[i]) + best_from(min(n, i + min(acc, k) + 1)) for k in range(length + 1))

    return best_from(0)


def test_the_bound_is_the_least_time_over_every_sequence_of_rounds(lb):
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 7)
        chains = []
        for _ in range(n):
            length = rng.randint(0, 3)
            chains.append((length, rng.randint(0, length), 3))
        slope, bump = rng.uniform(0.05, 1.5), rng.uniform(-0.2, 0.2)  # not always monotone in width
        f = lambda w, c, slope=slope, bump=bump: 1.0 + slope * (w - 1) + (bump if w == 3 else 0.0) + 0.001 * c
        cached = [10 + i for i in range(n)]
        t, rounds = lb.best_time(chains, f, cached)
        assert t == pytest.approx(brute_force(chains, f, cached))
        assert sum(rounds) == n  # the rounds it reports cover every position once


def test_a_round_never_moves_past_what_the_output_accepts(lb):
    # a chain of 3 of which 1 is accepted: the best round moves 2 positions, not 4
    f = lambda w, c: 1.0  # noqa: E731  (wide rounds free: only acceptance limits the bound)
    t, rounds = lb.best_time([(3, 1, 3), (0, 0, 0), (0, 0, 0), (0, 0, 0)], f, [0] * 4)
    assert rounds == [2, 1, 1] and t == 3.0


def test_the_calibrated_planner_runs_ar_where_chains_are_never_accepted(lb):
    chains = [(4, 0, 1)] * 6
    table = lb.acceptance_table(chains)
    assert table == {1: [0.0, 0.0, 0.0, 0.0]}
    f = lambda w, c: 1.0 + 0.1 * (w - 1)  # noqa: E731
    assert lb.calibrated_time(chains, f, [0] * 6, table) == (6.0, 6)


def test_the_calibrated_planner_bets_where_accepted_tokens_pay_for_the_width(lb):
    chains = [(4, 4, 3), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0)]
    f = lambda w, c: 1.0 + 0.1 * (w - 1)  # noqa: E731
    sure = {3: [1.0] * 4}
    assert lb.calibrated_time(chains, f, [0] * 5, sure) == (pytest.approx(1.4), 1)
    # the same chain believed unlikely: AR, one position a round
    assert lb.calibrated_time(chains, f, [0] * 5, {3: [0.05] * 4}) == (5.0, 5)


def test_acceptance_rates_are_conditional_on_reaching_the_position(lb):
    # position 0 reached 3 times, accepted twice; position 1 reached twice (after an accepted 0), accepted once
    table = lb.acceptance_table([(2, 2, 3), (2, 1, 3), (2, 0, 3)])
    assert table == {3: [pytest.approx(2 / 3), 0.5]}


def test_the_brute_force_itself_weighs_a_wide_round_against_two_ar_rounds():
    f = lambda w, c: {1: 1.0, 2: 1.5}[w]  # noqa: E731
    assert brute_force([(1, 1, 3), (1, 1, 3)], f, [0, 0]) == 1.5
    assert brute_force([(1, 0, 3), (1, 0, 3)], f, [0, 0]) == 2.0


def test_a_calibrated_bet_that_the_output_rejects_pays_its_width_and_moves_one_token(lb):
    chains = [(4, 0, 3), (0, 0, 0), (0, 0, 0)]
    f = lambda w, c: 1.0 + 0.1 * (w - 1)  # noqa: E731
    assert lb.calibrated_time(chains, f, [0] * 3, {3: [1.0] * 4}) == (pytest.approx(3.4), 3)
