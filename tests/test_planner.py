"""The one planner: calibration, expected tokens, and its choices for one row and for many under
GPU-like and CPU-like costs, the rows' room, a draining batch, padding to a cheaper width, and
what measured rounds teach it."""

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from selfspec.engine.planning.calibration import Calibrator, Forecast, acceptance
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.schedule.decoder import Decoder, generate_ids
from selfspec.engine.round.rounds import AR, Option, config_label
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.planning.planner import PROBE_MIN, Planner, log2_budgets

from conftest import SHIPPED, tiny_model

CFG = DecodeConfig(budget=32, block_length=16)


def _planner(cost, budgets=(1, 2, 4, 8, 16, 32), group_sizes=(4, 8, 16), **cfg):
    """A planner whose ledger affords any bet: these tests are about how options are valued (the
    floor that bounds bets is tests/test_floor.py's)."""
    pl = Planner(cost, DecodeConfig(**{"budget": max(budgets), "block_length": 16, **cfg}), budgets=list(budgets),
                 group_sizes=list(group_sizes))
    pl.ledger.funds = 1e9
    return pl


def _rows(*forecasts, rooms=None):
    """Rows as the planner reads them: a forecast and the tokens each may still emit."""
    rooms = rooms or [64] * len(forecasts)
    return [SimpleNamespace(forecast=f, room=r) for f, r in zip(forecasts, rooms)]


def _table(ms: dict, rows: int = 1):
    """A cost model from measured milliseconds per width (the same for any number of rows)."""
    w = tuple(sorted(ms))
    return CostModel("synthetic", "*", "any", "any", (rows,), w, (0,), (((tuple(ms[x] / 1e3 for x in w)),),))


def _tree(p_children: float, depth: int = 3, width: int = 2) -> Forecast:
    """A full tree of the given depth and width whose every node is accepted w.p. p_children."""
    parents, depths, frontier = [-1], [0], [0]
    for d in range(1, depth + 1):
        nxt = []
        for u in frontier:
            for _ in range(width):
                parents.append(u)
                depths.append(d)
                nxt.append(len(parents) - 1)
        frontier = nxt
    par = torch.tensor(parents)
    return Forecast(acceptance(torch.full((len(parents) - 1,), p_children / width), par), par, torch.tensor(depths),
                    kind="tree")


def _chain(p: float, n: int = 4) -> Forecast:
    acc, run = [1.0], 1.0
    for _ in range(n):
        run *= p
        acc.append(run)
    return Forecast(acc, kind="lookup")


CPU = CostModel.one_row((1, 2, 16, 33, 544), ((1.0, 1.4, 1.7, 2.1, 15.0),))


def test_acceptance_multiplies_down_paths_and_caps_siblings():
    chain = acceptance(torch.tensor([0.5, 0.5]), torch.tensor([-1, 0, 1]))
    assert chain.tolist() == [1.0, 0.5, 0.25]
    # two siblings claiming 0.8 each cannot both be the target's token: scaled to sum 1
    sib = acceptance(torch.tensor([0.8, 0.8]), torch.tensor([-1, 0, 0]))
    assert sib.tolist() == pytest.approx([1.0, 0.5, 0.5])
    # endpoint masses of the chain: 0.5, 0.25, 0.25 -> one group covers half, two cover 3/4
    cover = Forecast(chain, torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2])).coverage(2)
    assert cover == pytest.approx([0.5, 0.75, 1.0])


def test_calibrator_moves_from_the_score_prior_to_observed_acceptance():
    cal = Calibrator()
    x = torch.tensor([-0.25])
    assert cal.prob(x).item() == pytest.approx(torch.tensor(-0.125).exp().item(), rel=1e-6)
    for _ in range(50):
        cal.update(x, torch.tensor([True]), torch.tensor([False]))
    assert cal.prob(x).item() < 0.05
    assert cal.prob(torch.tensor([-3.2])).item() == pytest.approx(torch.tensor(-3.25 / 2).exp().item(), rel=1e-6)


def test_flat_costs_choose_the_largest_tree_with_a_group_on_every_node():
    opt = _planner(CostModel.flat()).choose(_rows(_tree(0.9, depth=5)), cache=100)
    assert opt == Option("tree", 32, 33, 16)


def test_cpu_like_costs_choose_ar_when_drafts_are_rarely_accepted_and_a_tree_when_they_are_sure():
    pl = _planner(CPU)
    assert pl.choose(_rows(_tree(0.1)), cache=100) == AR
    opt = _planner(CPU).choose(_rows(_tree(0.98, depth=6)), cache=100)
    assert opt.draft == "tree" and opt.nodes > 0


def test_the_rows_room_caps_what_a_round_is_worth():
    """A row that may emit one more token gains nothing from drafts; two tokens of room make a
    deep chain worth no more than one draft."""
    flat = _planner(CostModel.flat())
    assert flat.choose(_rows(_chain(0.99, 8), rooms=[1]), cache=10) == AR
    steep = _planner(_table({1: 10.0, 2: 11.0, 3: 15.0, 9: 40.0}))
    assert steep.choose(_rows(_chain(0.99, 8), rooms=[64]), cache=10).nodes == 8
    assert steep.choose(_rows(_chain(0.99, 8), rooms=[2]), cache=10) == Option("lookup", 1)


def test_rounds_without_marginals_probe_now_and_then_and_less_often_while_losing():
    pl = _planner(CostModel.one_row((1, 16, 544), ((1.0, 1.7, 15.0),)), budgets=(1, 2, 4), group_sizes=(4,))
    picks = [pl.choose(_rows(Forecast()), cache=10) for _ in range(40)]
    probes = [i for i, o in enumerate(picks) if o.groups]
    assert probes and all(o == AR for i, o in enumerate(picks) if i not in probes)
    assert all(picks[i] == Option(groups=1, group_size=4) for i in probes)



def test_probes_come_less_often_while_their_marginals_lose_time_and_at_the_least_again_once_they_win():
    """Judged by what the rounds took: a probe (4 AR times, one token) whose marginals led to one
    more AR-like round loses ~3 AR rounds, and the spacing doubles once the marginals are gone; an
    episode whose tree round commits 6 tokens in 2 AR times wins, and probes come every PROBE_MIN."""
    from selfspec.engine.planning.planner import PROBE_MAX

    pl = _planner(CostModel.flat(0.1), budgets=(1, 2, 4), group_sizes=(4,))
    probe = Option(groups=1, group_size=4)
    for doubled in (16, 32):
        _observe(pl, AR, 0.1)
        _observe(pl, probe, 0.4, marginals=True)
        _observe(pl, AR, 0.1, marginals=True)  # the marginals' forecast chose AR
        assert pl.probe_every == PROBE_MIN * (doubled // 16)  # not judged while they are at hand
        _observe(pl, AR, 0.1)
        assert pl.probe_every == doubled
    _observe(pl, probe, 0.4, marginals=True)
    _observe(pl, Option("tree", 8), 0.2, marginals=True, committed=6)
    _observe(pl, AR, 0.1)
    assert pl.probe_every == PROBE_MIN
    for _ in range(8):
        _observe(pl, probe, 0.4, marginals=True)
        _observe(pl, AR, 0.1)
    assert pl.probe_every == PROBE_MAX


def test_a_probe_whose_marginals_lost_more_than_its_forward_spaces_the_next_by_what_they_lost():
    """On flat costs a probe's forward costs what AR's does, but the tree forecast its marginals
    bring can take an AR round's time and buy nothing: the next probe then waits until that loss
    is PROBE_SHARE of the AR time since (not only the doubled PROBE_MIN)."""
    from selfspec.engine.planning.planner import PROBE_SHARE

    pl = _planner(CostModel.flat(0.1), budgets=(1, 2, 4), group_sizes=(4,))
    _observe(pl, Option(groups=1, group_size=4), 0.1, marginals=True)
    _observe(pl, AR, 0.1, marginals=True, plan=0.1)  # the forecast: one AR round's time, then AR
    _observe(pl, AR, 0.1)
    assert pl.probe_loss == pytest.approx(1.0) and pl.probe_every == 2 * PROBE_MIN
    picks = [pl.choose(_rows(Forecast()), cache=10) for _ in range(int(1.0 / PROBE_SHARE) + 8)]
    first = next(i for i, o in enumerate(picks) if o.groups)
    assert first + 1 >= 1.0 / PROBE_SHARE > 2 * PROBE_MIN


def test_resting_rounds_are_accounted_when_the_rest_ends_exactly_as_they_would_have_been_at_once():
    """Bare rounds while the planner rests only leave their numbers; when the rest ends (or the
    planner is forked for the next generation) the ledger, time scales and overheads are bitwise
    what settling each round at once gives."""
    at_once, resting = _planner(CostModel.flat(0.1)), _planner(CostModel.flat(0.1))
    times = [0.1, 0.13, 0.09, 0.5, 0.11]
    for pl in (at_once, resting):
        pl.ledger.funds = 1.0
    resting.dormant = 3
    for t in times[:-1]:
        for pl in (at_once, resting):
            rnd = SimpleNamespace(option=AR, rows=[SimpleNamespace(nodes=0, committed=[7], room=64, marg=None)],
                                  width=1, cache_len=40, model_seconds=0.8 * t, seconds=t, plan_seconds=0.0,
                                  bare=True, draining=False, join_tokens=0, refresh=False, target_seconds=0.0,
                                  target_rows=0)
            pl.observe(rnd)
    assert len(resting.unsettled) == 4 and not at_once.unsettled
    assert resting.ledger.rounds == 0.0 and "ar" not in resting.costs.scale
    forked = resting.fork()
    resting.dormant = 0
    for pl in (at_once, resting):
        pl.observe(SimpleNamespace(option=AR, rows=[SimpleNamespace(nodes=0, committed=[7], room=64, marg=None)],
                                   width=1, cache_len=40, model_seconds=0.8 * times[-1], seconds=times[-1],
                                   plan_seconds=0.0, bare=True, draining=False, join_tokens=0, refresh=False,
                                   target_seconds=0.0, target_rows=0))
        pl.settle()  # plain AR rounds settle SETTLE_AFTER at a time: the fifth waits
    state = lambda pl: (pl.ledger, pl.costs.scale, pl.costs.overhead, pl.costs._recent)  # noqa: E731
    assert state(resting) == state(at_once) and not resting.unsettled
    assert not forked.unsettled and forked.ledger.rounds > 0


def test_a_forecast_the_funds_cannot_cover_waits_until_they_would_and_its_rounds_settle_in_one_batch():
    """A forecast costing half an AR round with 0.11 in the funds: they grow by EPS an AR round, so
    the planner rests 0.39 / EPS rounds (the round the per-round check would also have allowed it),
    only noting each one, and settles them when the rest ends."""
    from selfspec.engine.planning.round_costs import EPS

    n = math.ceil((0.5 - 0.11) / EPS - 1e-9)
    pl = _planner(CostModel.flat(0.1))
    pl.ledger.funds, pl.ledger.plan_seconds, pl.costs.scale["ar"] = 0.11, 0.05, 1.0
    forecast_at, waiting = [], []
    pl.forecast = lambda r: forecast_at.append(len(waiting)) or Forecast()
    for _ in range(n + 4):
        row = SimpleNamespace(marg=None, room=64, committed=[7], nodes=0, drafted=None)
        rnd = SimpleNamespace(rows=[row], cache_len=10, draining=False, bare=False, join_tokens=0, refresh=False,
                              width=1, model_seconds=0.1, seconds=0.1, plan_seconds=0.0, target_seconds=0.0,
                              target_rows=0)
        rnd.option = pl.plan(rnd)
        pl.observe(rnd)
        waiting.append(len(pl.unsettled))
    assert forecast_at[0] == n
    assert waiting[:n] == list(range(1, n)) + [0]


def test_a_round_with_nothing_to_offer_is_chosen_as_the_full_choice_would_choose_it():
    """`plain` (no chain, no marginals, no two-pass yields) answers AR or the probe exactly as
    `Choice.best` does, and leaves the planner in the same state, round after round."""
    from selfspec.engine.planning.choice import Choice, nothing_to_offer, plain

    costly = _table({1: 1.0, 5: 4.0, 16: 6.0})
    for cost, funds in ((costly, 1e9), (costly, 0.5), (CostModel.flat(0.1), 1e9)):
        fast, full = _planner(cost, budgets=(1, 2, 4), group_sizes=(4,)), _planner(cost, budgets=(1, 2, 4),
                                                                                 group_sizes=(4,))
        for pl in (fast, full):
            pl.ledger.funds = funds
        for i in range(300):
            draining = i % 3 == 0
            rows = _rows(Forecast(), Forecast(), rooms=[64, 1 + i % 5])
            assert nothing_to_offer(fast, rows, 10, draining)
            a, b = plain(fast, rows, 10, draining), Choice(full, rows, 10, draining).best()
            assert a == b
            assert (fast.since_probe, fast.rates, fast.predicted) == (full.since_probe, full.rates, full.predicted)
    assert not nothing_to_offer(fast, _rows(_chain(0.9, 2)), 10, False)


def test_a_lookup_chain_that_cannot_beat_ar_is_chosen_without_valuing_it_as_the_full_choice_would():
    """Chains whose best case (every token accepted as forecast, at the least time of any length)
    is worth less than AR go to `plain`: the same option and planner state as `Choice.best`, over
    chains of every length and likelihood, one or two rows, draining or not, with funds or none."""
    from selfspec.engine.planning.choice import Choice, nothing_to_offer, plain

    gen = torch.Generator().manual_seed(0)
    costly = _table({1: 1.0, 2: 1.1, 4: 1.3, 5: 2.0, 8: 2.4, 16: 4.0}, rows=2)
    hopeless = 0
    for cost, funds in ((costly, 1e9), (costly, 0.2), (CostModel.flat(0.1), 1e9)):
        fast, full = _planner(cost, budgets=(1, 2, 4), group_sizes=(4,)), _planner(cost, budgets=(1, 2, 4),
                                                                                 group_sizes=(4,))
        for pl in (fast, full):
            pl.ledger.funds = funds
        for i in range(400):
            draining, p = i % 3 == 0, float(torch.rand(1, generator=gen)) ** 3
            n = 1 + int(torch.randint(10, (1,), generator=gen))
            rows = _rows(_chain(p, n), *([Forecast()] if i % 2 else []), rooms=[64, 1 + i % 5][: 1 + i % 2])
            if not nothing_to_offer(fast, rows, 10, draining):
                Choice(fast, rows, 10, draining).best(), Choice(full, rows, 10, draining).best()
                continue
            hopeless += 1
            assert plain(fast, rows, 10, draining) == Choice(full, rows, 10, draining).best()
            assert (fast.since_probe, fast.rates, fast.predicted) == (full.since_probe, full.rates, full.predicted)
    assert 200 < hopeless < 1100  # both kinds of chain were met


def test_an_expensive_probe_comes_seldom_enough_to_cost_a_probe_share_of_the_time_at_most():
    """A probe commits one token, like AR; its extra time is a bet on marginals. When a group of
    4 costs 4 AR steps (int4 with the draft LoRA on a CPU), probes every 8 rounds would spend ~30%
    of the time on the bet: they are spaced so that they spend at most PROBE_SHARE of it."""
    from selfspec.engine.planning.planner import PROBE_SHARE

    pl = _planner(_table({1: 1.0, 5: 4.0, 16: 6.0}), budgets=(1, 2, 4), group_sizes=(4,))
    pl.rest = 0  # no resting: every round asks whether to probe
    picks = []
    for _ in range(200):
        pl.ar_streak = 0
        picks.append(pl.choose(_rows(Forecast()), cache=10))
    probes = sum(1 for o in picks if o.groups)
    extra = 3.0  # f(5) - f(1)
    assert 1 <= probes and probes * extra <= PROBE_SHARE * (len(picks) - probes) * 1.0 + extra


def test_a_prefill_adds_marginals_only_while_they_pay_and_cost_little():
    """The prefill's mask group is a probe at round 0: on flat costs it is taken; where it costs
    6 AR steps only for a generation long enough to hide it (at most PROBE_SHARE of its AR time);
    and never while probes keep losing."""
    from selfspec.engine.planning.planner import PROBE_SHARE

    flat = _planner(CostModel.flat())
    assert flat.marginals_at_prefill(rows=1, cache=10, group=16, room=3)
    steep = _planner(_table({1: 1.0, 5: 4.0, 16: 6.0}))
    long_enough = int(6.0 / PROBE_SHARE) + 1  # its forward: 6 AR steps
    assert not steep.marginals_at_prefill(rows=1, cache=10, group=16, room=long_enough - 2)
    assert steep.marginals_at_prefill(rows=1, cache=10, group=16, room=long_enough)
    steep.probe_every = 2 * PROBE_MIN  # the latest marginals led to no draft worth verifying
    assert not steep.marginals_at_prefill(rows=1, cache=10, group=16, room=long_enough)


def test_plan_rests_after_a_run_of_ar_choices_without_forecasting_anything():
    """plan() owns the rest: after 8 AR choices it answers AR for `rest` rounds without asking any
    row for a forecast (no drafting, no lookups); marginals at hand end the rest early."""
    pl = _planner(CostModel.one_row((1, 16, 544), ((1.0, 1.7, 15.0),)), budgets=(1, 2, 4), group_sizes=(4,))
    calls = []
    pl.forecast = lambda r: calls.append(1) or _tree(0.05)

    def rnd(marg):
        return SimpleNamespace(rows=[SimpleNamespace(marg=marg, room=50, forecast=None, drafted=None)], cache_len=10,
                               draining=True)

    for _ in range(8):
        assert pl.plan(rnd(object())) == AR
    assert len(calls) == 8 and pl.dormant == 4
    for _ in range(4):
        assert pl.plan(rnd(None)) == AR
    assert len(calls) == 8 and pl.dormant == 0
    pl.plan(rnd(None))
    assert len(calls) == 9


def test_lookup_is_chosen_for_a_batch_only_when_its_yield_beats_the_width_cost():
    """Eight rows with chains of 4 on this CPU's measured batch-of-8 curve (ms)."""
    cpu = _table({1: 93.0, 2: 124.0, 3: 150.0, 4: 172.0, 5: 200.0, 16: 500.0, 17: 520.0}, rows=8)
    assert _planner(cpu).choose(_rows(*[_chain(0.95)] * 8), cache=100).draft == "lookup"
    assert _planner(cpu).choose(_rows(*[_chain(0.1)] * 8), cache=100) == AR
    assert _planner(CostModel.flat()).choose(_rows(*[_chain(0.1)] * 8), cache=100) == Option("lookup", 4)
    assert _planner(cpu).choose(_rows(*[Forecast()] * 8), cache=100) == AR  # nothing to copy: nothing to verify


def test_a_draining_batch_speculates_only_for_the_rows_that_end_it():
    """No prompt waits: a likely chain on a row that will finish early is not worth the wider
    round; the same chain on every row with the most tokens left is."""
    cpu = _table({1: 93.0, 2: 124.0, 3: 150.0, 4: 172.0, 5: 200.0}, rows=3)
    rows = lambda rooms: _rows(_chain(0.95), _chain(0.95), Forecast(), rooms=rooms)  # noqa: E731
    assert _planner(cpu).choose(rows([12, 12, 30]), cache=100).draft == "lookup"  # a queue keeps the batch full
    assert _planner(cpu).choose(rows([12, 12, 30]), cache=100, draining=True) == AR  # the last row gains nothing
    assert _planner(cpu).choose(rows([30, 30, 12]), cache=100, draining=True).draft == "lookup"


def test_a_round_pads_to_a_wider_width_the_device_runs_cheaper():
    """fp32 on a CPU can run 5 query tokens faster than 4: a chain of 3 drafts pads to width 5."""
    dip = _table({1: 50.0, 2: 80.0, 3: 110.0, 4: 130.0, 5: 115.0, 8: 140.0})
    opt = _planner(dip).choose(_rows(_chain(0.97, 3)), cache=10)
    assert opt == Option("lookup", 3, pad_to=5) and opt.width == 5 and opt.label == "lookup/N=3"


def _observe(pl, option, seconds, rows=4, width=None, marginals=False, committed=1, plan=0.0, bare=False):
    row = SimpleNamespace(nodes=0, committed=[7] * committed, room=64, marg=object() if marginals else None)
    rnd = SimpleNamespace(option=option, rows=[row] * rows, width=width or option.width, cache_len=0,
                          model_seconds=seconds, seconds=seconds + plan, plan_seconds=plan, bare=bare,
                          draining=False, join_tokens=0, refresh=False, target_seconds=0.0, target_rows=0)
    pl.observe(rnd)


def test_a_cost_model_that_underprices_wide_rounds_is_corrected_by_what_they_took():
    """The cost model says a width-2 round costs what AR costs; measured lookup rounds take twice
    AR's time (the reference: bare AR rounds): after a few, a yield of 1.3 tokens per row no
    longer buys them."""
    pl = _planner(CostModel.flat(0.1))
    rows = _rows(*[_chain(0.3, 1)] * 4)
    assert pl.choose(rows, cache=0) == Option("lookup", 1)
    for _ in range(5):
        _observe(pl, AR, 0.1, bare=True)
        _observe(pl, Option("lookup", 1), 0.2)
    assert pl.choose(rows, cache=0) == AR


def test_a_kind_is_priced_against_ar_rounds_of_its_own_time_not_against_the_machine_s_drift():
    """The machine's speed drifts: lookups measured at half speed (before any AR round, as in a
    warm-up; then beside AR rounds as slow as they) are priced like AR once it runs at full speed
    again, not at the speed they happened to run at."""
    rows = _rows(*[_chain(0.3, 1)] * 4)
    warm = _planner(CostModel.flat(0.1))
    for _ in range(5):
        _observe(warm, Option("lookup", 1), 0.2)  # no AR round yet: nothing to compare them with
    for _ in range(40):
        _observe(warm, AR, 0.1, bare=True)
    warm.settle()
    assert warm.choose(rows, cache=0) == Option("lookup", 1)
    drift = _planner(CostModel.flat(0.1))
    for _ in range(40):
        _observe(drift, AR, 0.2, bare=True)
        _observe(drift, Option("lookup", 1), 0.2)
    for _ in range(40):
        _observe(drift, AR, 0.1, bare=True)
    drift.settle()
    assert drift.choose(rows, cache=0) == Option("lookup", 1)


def test_before_any_ar_round_every_kind_is_priced_on_the_clock_of_the_rounds_that_ran():
    """Lookups ran at twice the cost model's time before any AR round: AR is priced at that speed
    too (the same clock), and lookups like AR (nothing yet says they differ)."""
    pl = _planner(CostModel.flat(0.1))
    for _ in range(3):
        _observe(pl, Option("lookup", 1), 0.2)
    pl.settle()
    assert pl.costs.model_seconds("ar", 1, 1, 0) == pytest.approx(0.2)
    assert pl.costs.model_seconds("lookup", 1, 2, 0) == pytest.approx(0.2)


def test_a_chain_pays_for_every_target_token_it_draws_and_sampled_draws_can_price_it_out():
    """A sampled target token costs ~0.5 ms on a CPU (argmax's ~20 us): a round verifying a chain
    of 3 draws 4 of them. The planner measures the time per draw apart from the per-row overhead
    (the same in AR and lookup rounds here) and prices each option's draws: on flat 10 ms forwards
    a chain accepted at 0.2 per token is worth verifying with cheap draws, not with 5 ms ones."""
    def planner(draw):
        pl = _planner(CostModel.flat(0.01))
        for _ in range(3):
            for option, rows in ((AR, 1), (Option("lookup", 3), 4)):
                pl.observe(SimpleNamespace(option=option, rows=[SimpleNamespace(nodes=0, committed=[7], room=64,
                                                                                marg=None)],
                                           width=option.width, cache_len=0, model_seconds=0.01,
                                           seconds=0.01 + 0.001 + draw * rows, plan_seconds=0.0, bare=False,
                                           draining=False, join_tokens=0, refresh=False, target_seconds=draw * rows,
                                           target_rows=rows))
        return pl

    cheap, dear = planner(20e-6), planner(5e-3)
    assert cheap.costs.draw == pytest.approx(20e-6) and dear.costs.draw == pytest.approx(5e-3)
    assert cheap.costs.overhead["lookup"] == pytest.approx(dear.costs.overhead["lookup"]) == pytest.approx(1e-3)
    rows = _rows(_chain(0.2, 3))
    assert cheap.choose(rows, cache=0).draft == "lookup"
    assert dear.choose(rows, cache=0) == AR


def test_a_batched_round_fades_old_evidence_once_not_once_per_row():
    pl = _planner(CostModel.flat())
    for _ in range(50):
        pl.lookup_calibrator.update(2, 2, (3, 0))
    before = pl.lookup_calibrator.counts[(3, 0)][0][0]
    row = SimpleNamespace(nodes=2, path=[0], chain_key=(3, 0), drafted=[4, 5], committed=[7], room=64, marg=None,
                          seq=SimpleNamespace(lookup_run=0, done=False))
    pl.observe(SimpleNamespace(option=Option("lookup", 2), rows=[row] * 16, width=3, cache_len=0, model_seconds=1.0,
                               seconds=1.0, plan_seconds=0.0, bare=False, draining=False, join_tokens=0,
                               refresh=False, target_seconds=0.0, target_rows=0))
    assert pl.lookup_calibrator.counts[(3, 0)][0][0] == pytest.approx(before * pl.lookup_calibrator.forget + 16)


def test_auto_greedy_matches_ar_under_any_costs():
    m = tiny_model(seed=1, vocab_size=12)
    p = torch.randint(5, 12, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0]
    cpu = CostModel.one_row((1, 16, 544), ((1e-3, 1.7e-3, 15e-3),))
    for prof in (CostModel.flat(), cpu):
        out, st = generate_ids(m, p, DecodeConfig(max_new_tokens=40, block_length=8), eos_token_id=[], profile=prof)
        assert out == ar
        assert sum(st.plan_hist.values()) == st.rounds


shipped = pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "model.safetensors")), reason="no shipped model")


@shipped
def test_on_the_shipped_model_a_flat_cost_model_plans_one_pass_presto_with_budget_32(default_model):
    model, tok = default_model
    with open(os.path.join(SHIPPED, "prompts.jsonl")) as f:
        prompt = json.loads(f.readline())["prompt"]
    dec = Decoder(model, [tok.encode(prompt)], DecodeConfig(max_new_tokens=48), profile=CostModel.flat())
    chosen, plan = [], dec.planner.plan

    def recording(rnd):
        chosen.append(plan(rnd))
        return chosen[-1]

    dec.planner.plan = recording
    rounds = iter(dec)
    next(rounds), next(rounds)  # the prefill's token, then the first round (planned on the prefill's group)
    opt = chosen[0]
    assert opt.nodes >= 32 and opt.groups == opt.nodes + 1 and not opt.draft_pass


def test_expected_tokens_of_n_nodes_are_those_of_the_subtree_the_runtime_verifies():
    from selfspec.drafting.tree import Tree, top_nodes

    # index order (depth by depth) differs from score order: node 3 (depth 2) beats node 2 (depth 1)
    tree = Tree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]),
                torch.tensor([0.0, -0.1, -3.0, -0.2]))
    acc = torch.tensor([1.0, 0.9, 0.05, 0.8], dtype=torch.float64)
    y = Forecast(acc, tree.parents, tree.depths, tree.scores, "tree").yields()
    for n in range(4):
        sub = top_nodes(tree, n)
        kept = [tree.tokens.tolist().index(t) for t in sub.tokens.tolist()]
        assert y[n] == pytest.approx(float(acc[kept].sum()))


def test_layout_labels_of_rounds_settings_and_bench_rows_are_spelled_by_one_function():
    from selfspec.tools.bench import label

    assert [AR.label, Option("tree", 8).label, Option("tree", 8, draft_pass=True).label,
            Option("tree", 8, 9, 16).label, Option("lookup", 10).label, Option("chain", 7, draft_pass=True).label,
            Option(groups=1, group_size=4).label] == [
        "ar", "verify/N=8", "two-pass/N=8", "one-pass/N=8/m=9/G=16", "lookup/N=10", "linear/two-pass/N=7",
        "one-pass/N=0/m=1/G=4"]
    presto = DecodeConfig(mode="presto", schedule="one-pass", budget=32, lookup=True)
    assert [config_label(DecodeConfig(mode=m)) for m in ("ar", "lookup", "auto")] == ["ar", "lookup", "auto"]
    assert config_label(DecodeConfig(mode="linear", schedule="two-pass")) == "linear/two-pass"
    assert config_label(presto) == "presto/one-pass/N=32/lookup"
    assert label(presto) == "hybrid/one-pass/N=32" and label(DecodeConfig(mode="linear")) == "linear/one-pass"
    assert log2_budgets(32) == [1, 2, 4, 8, 16, 32] and log2_budgets(6) == [1, 2, 4, 6]


def test_an_option_is_checked_at_construction():
    with pytest.raises(ValueError, match="unknown draft"):
        Option("beam", 3)
    with pytest.raises(ValueError, match="with 0 nodes"):
        Option("tree", 0)
    with pytest.raises(ValueError, match="negative"):
        Option("lookup", 2, pad_to=-1)


def test_a_forked_planners_calibrators_learn_apart_from_the_one_it_was_forked_from():
    """A generation's fork counts acceptance in its own calibrators: the stored planner (and any
    other generation forked from it) sees nothing until the fork is kept."""
    stored = _planner(CostModel.flat(0.1))
    stored.lookup_calibrator.update(4, 2, match=3)
    before = (stored.calibrator.reached.clone(), stored.calibrator.accepted.clone(),
              {m: (list(r), list(a)) for m, (r, a) in stored.lookup_calibrator.counts.items()})
    forked = stored.fork()
    forked.calibrator.update(torch.tensor([-0.1, -2.0]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0]))
    forked.lookup_calibrator.update(6, 5, match=3)
    forked.lookup_calibrator.update(2, 0, match=2)
    after = (stored.calibrator.reached, stored.calibrator.accepted, stored.lookup_calibrator.counts)
    assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]) and after[2] == before[2]
    assert not torch.equal(forked.calibrator.reached, before[0]) and forked.lookup_calibrator.counts != before[2]


def test_plain_ar_rounds_settle_four_at_a_time_as_they_would_one_by_one_and_a_drafting_round_at_once():
    """The ledger, time scales and overheads after plain AR rounds settled SETTLE_AFTER at a time
    are bitwise those of settling each at once; a round that drafted settles with them right away
    (the next choice reads its outcome)."""
    from selfspec.engine.planning.planner import SETTLE_AFTER

    batched, single = _planner(CostModel.flat(0.1)), _planner(CostModel.flat(0.1))
    pending = []
    for i, t in enumerate([0.1, 0.12, 0.09, 0.11, 0.1, 0.13, 0.1]):
        for pl in (batched, single):
            _observe(pl, AR, t, rows=1)
        single.settle()
        pending.append(len(batched.unsettled))
    assert pending == [1, 2, 3, 0, 1, 2, 3] and SETTLE_AFTER == 4
    for pl in (batched, single):
        _observe(pl, Option("lookup", 2), 0.15, rows=1, width=3, committed=2)
    assert not batched.unsettled
    state = lambda pl: (pl.ledger, pl.costs.scale, pl.costs.overhead, pl.costs._recent)  # noqa: E731
    assert state(batched) == state(single)


def test_a_dear_probe_comes_every_probe_min_rounds_while_the_latest_marginals_won_more_than_it_risks():
    """Drafts that succeed (a real NLD model's, `--replay`): a probe 3 AR steps dear would wait
    ~3 / PROBE_SHARE AR rounds, longer than most answers, and auto never met its marginals. Once
    an episode of marginals won more AR rounds than a probe risks, probes (and the prefill's group)
    come as often as PROBE_MIN allows; once one loses, the spacing is the probe's loss again."""
    from selfspec.engine.planning.planner import PROBE_SHARE

    pl = _planner(_table({1: 1.0, 5: 4.0, 16: 6.0}), budgets=(1, 2, 4), group_sizes=(4,))
    pl.rest = 0
    long_enough = int(6.0 / PROBE_SHARE) + 1

    def first_probe():
        pl.since_probe = 0
        for i in range(200):
            pl.ar_streak = 0
            if pl.choose(_rows(Forecast()), cache=10).groups:
                return i
        return None

    assert first_probe() + 1 >= 3.0 / PROBE_SHARE  # no episode won yet: spaced by its loss
    assert not pl.marginals_at_prefill(rows=1, cache=10, group=16, room=16)
    pl.marg_gain = 8.0  # the latest marginals' rounds won 8 AR rounds: more than a probe risks (3), or the prefill's group (6)
    pl.close_episode()
    assert pl.last_win == 8.0 and first_probe() + 1 == PROBE_MIN
    assert pl.marginals_at_prefill(rows=1, cache=10, group=16, room=16) and 16 < long_enough
    pl.marg_gain = -1.0  # the next episode lost
    pl.close_episode()
    assert pl.last_win == 0.0 and first_probe() + 1 >= 3.0 / PROBE_SHARE
