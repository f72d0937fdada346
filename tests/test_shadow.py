"""Lookup chains `auto` read but did not verify are followed in hindsight
(`engine/planning/calibration.py`, `Shadow`): the calibration learns from them, and what the bet
the ledger could not afford would have won may fund the next lookup bet, within a bound."""

from types import SimpleNamespace

import pytest

from selfspec.engine.planning import round_costs as ledger_mod
from selfspec.engine.planning.calibration import PositionCalibrator
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.round.rounds import Option
from selfspec.engine.planning.round_costs import Ledger
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.planning.planner import Planner
from selfspec.engine.planning.calibration import Shadow, follow

from matrix import FORMATS


def test_a_shadow_ends_at_its_first_wrong_token_or_when_the_whole_chain_came_true():
    assert follow([4, 9, 2], 0, [4]) == (1, False)
    assert follow([4, 9, 2], 1, [9, 7]) == (2, True)
    assert follow([4, 9, 2], 0, [4, 9, 2]) == (3, True)
    assert follow([4, 9, 2], 0, [5]) == (0, True)
    assert follow([4, 9, 2], 2, []) == (2, False)  # a round that committed nothing for the row


def test_the_module_example_takes_two_tokens_and_the_bonus():
    seen, ended = 0, False
    for committed in ([4], [9], [7]):
        seen, ended = follow([4, 9, 9, 2], seen, committed)
    assert (seen, ended) == (2, True)


def test_a_shadows_gain_is_its_bets_tokens_and_bonus_less_the_rounds_time_in_the_rows_share():
    s = Shadow([4, 9, 9, 2], (3, 0), k=3, share=0.5, spent=1.3)
    assert s.gain(2) == pytest.approx(0.5 * (3 - 1.3))
    assert s.gain(4) == pytest.approx(0.5 * (4 - 1.3))  # the bet verified 3 tokens, however long the chain ran
    assert s.gain(0) == pytest.approx(0.5 * (1 - 1.3))


def test_hindsight_funds_lookup_bets_only_and_up_to_its_cap():
    led = Ledger(funds=0.0)
    led.credit(5.0)
    assert led.shadow == ledger_mod.SHADOW_CAP
    assert led.may_bet(ledger_mod.SHADOW_CAP, lookup=True) and not led.may_bet(0.1)  # probes and trees: real funds
    led.credit(-10.0)
    assert led.shadow == 0.0


def test_a_lookup_bet_hindsight_paid_for_and_lost_empties_it_and_halves_its_cap_and_a_won_one_restores_it():
    led = Ledger(funds=0.0)
    led.credit(1.0)
    led.record(committed=1.0, seconds=0.013, ar_seconds=0.01, bare=False, lookup=True)  # lost 0.3 AR rounds
    assert led.shadow == 0.0 and led.shadow_cap == ledger_mod.SHADOW_CAP / 2
    assert led.funds == pytest.approx(0.0)  # the deficit came from hindsight
    led.credit(1.0)
    assert led.shadow == ledger_mod.SHADOW_CAP / 2
    led.record(committed=4.0, seconds=0.013, ar_seconds=0.01, bare=False, lookup=True)
    assert led.shadow_cap == ledger_mod.SHADOW_CAP


def test_a_bet_paid_from_real_funds_leaves_hindsight_alone():
    led = Ledger(funds=2.0)
    led.credit(0.4)
    led.record(committed=1.0, seconds=0.013, ar_seconds=0.01, bare=False, lookup=True)
    assert led.shadow == pytest.approx(0.4) and led.shadow_cap == ledger_mod.SHADOW_CAP


def test_evidence_from_a_later_start_counts_only_the_later_positions():
    cal = PositionCalibrator(prior=0.5, prior_weight=4.0, forget=1.0)
    cal.update(6, 4, 3, start=2)  # positions 0, 1 counted by the round that verified them
    reached, accepted = cal.counts[3]
    assert reached[:6] == [0, 0, 1, 1, 1, 0] and accepted[:6] == [0, 0, 1, 1, 0, 0]


class _Seq:  # a sequence as the planner reads it (hashable by identity, as `sequence.Sequence`)
    lookup_run, done, cancelled = 0, False, False


def _row(seq, drafted=None, committed=(), key=(3, 0)):
    forecast = SimpleNamespace(kind="lookup") if drafted else None
    return SimpleNamespace(seq=seq, drafted=drafted, forecast=forecast, chain_key=key, committed=list(committed),
                           marg=None, room=64, nodes=0)


def test_the_planner_follows_a_chain_it_did_not_bet_on_and_learns_from_it():
    pl = Planner(CostModel.flat(), DecodeConfig(max_new_tokens=64))
    seq = _Seq()
    rnd = SimpleNamespace(rows=[_row(seq, drafted=[4, 9, 9, 2])], draining=False, cache_len=10)
    pl._shadow(rnd, None)
    before = pl.lookup_calibrator.prob(4, (3, 0))
    for tok in (4, 9, 9, 2):  # AR rounds commit the chain, token by token
        pl._follow(SimpleNamespace(rows=[_row(seq, committed=[tok])]))
    assert pl.shadows == {} and seq.lookup_run == 1
    after = pl.lookup_calibrator.prob(4, (3, 0))
    assert all(a > b for a, b in zip(after, before))


def test_a_blocked_bet_is_credited_once_its_length_has_come_true():
    pl = Planner(CostModel.flat(), DecodeConfig(max_new_tokens=64))
    pl.ledger.funds = 0.0
    seq = _Seq()
    rnd = SimpleNamespace(rows=[_row(seq, drafted=[4, 9, 9, 2, 5, 5])], draining=False, cache_len=10)
    pl._shadow(rnd, (1.0, Option("lookup", 2), 0.0))  # (value, option, its time in AR rounds: none here)
    pl._follow(SimpleNamespace(rows=[_row(seq, committed=[4])]))
    assert pl.ledger.shadow == 0.0
    pl._follow(SimpleNamespace(rows=[_row(seq, committed=[9])]))
    assert pl.ledger.shadow == pytest.approx(min(ledger_mod.SHADOW_CAP, 2 + 1 - 0.0))
    assert seq in pl.shadows  # the chain is still followed for the calibration


def test_the_rest_of_a_chain_a_lookup_round_took_whole_is_followed_past_the_verified_length():
    # else positions past the bets' lengths keep their prior and cap the chains at those lengths
    pl = Planner(CostModel.flat(), DecodeConfig(max_new_tokens=64))
    seq = _Seq()
    chain = [4, 9, 9, 2, 5, 6]
    verified = _row(seq, drafted=chain, committed=chain[:3] + [2])  # 3 verified and taken, the bonus = chain[3]
    pl._follow_rest(verified, 3)
    pl._follow(SimpleNamespace(rows=[_row(seq, committed=[5])]))
    pl._follow(SimpleNamespace(rows=[_row(seq, committed=[7])]))  # chain[5] = 6: wrong
    reached, accepted = pl.lookup_calibrator.counts[(3, 0)]
    assert reached[:7] == [0, 0, 0, 1, 1, 1, 0] and accepted[:7] == [0, 0, 0, 1, 1, 0, 0]
    assert pl.shadows == {}


def test_a_rows_chain_is_forecast_from_chains_that_came_true_as_often_as_its_rows_did(monkeypatch):
    from selfspec.engine.planning import planner as planner_mod

    pl = Planner(CostModel.flat(), DecodeConfig(max_new_tokens=64))
    for _ in range(40):
        pl.lookup_calibrator.update(4, 4, (3, planner_mod.RUN_KEYS))  # a model's loop: every chain right
        pl.lookup_calibrator.update(4, 0, (3, 0))  # elsewhere: wrong
    monkeypatch.setattr(planner_mod, "lookup_chain", lambda seq, cfg, room: setattr(seq, "match", 3) or [1, 2, 3, 4])

    def row(run):
        return SimpleNamespace(room=64, marg=None, seq=SimpleNamespace(lookup=object(), lookup_run=run, match=1))

    looping, fresh = row(5), row(0)
    assert pl.forecast(looping).accept[1] > 0.9 and pl.forecast(fresh).accept[1] < 0.2
    assert looping.chain_key == (3, planner_mod.RUN_KEYS) and fresh.chain_key == (3, 0)


def test_a_finished_generation_leaves_no_sequence_in_the_planner_kept_for_the_next():
    # a chain still followed holds its sequence (a 3,000-token prompt's lookup index) until the next
    # generation with the same settings would have begun
    from selfspec.engine.planning.planner_store import keep_planner, planner_for

    model = SimpleNamespace()
    pl = planner_for(model, DecodeConfig(max_new_tokens=64), CostModel.flat())
    seq = _Seq()
    pl._shadow(SimpleNamespace(rows=[_row(seq, drafted=[4, 9])], draining=False, cache_len=10), None)
    assert seq in pl.shadows
    keep_planner(pl)
    kept = list(model.__dict__["_selfspec_planners"].values())
    assert kept == [pl] and pl.shadows == {}


@pytest.mark.parametrize("fmt", FORMATS)
def test_in_every_weight_format_hindsight_pays_the_first_bet_on_a_loop_and_greedy_output_is_ar(fmt, monkeypatch):
    # the tiny model's answer loops (15, 3, 13, 13, ...): real context chains, verified for real, on a
    # fake clock that prices rounds as a CPU does, from a ledger without funds
    from selfspec.engine.measure.formats import set_weights

    from test_floor import N, _model_and_prompt, _run

    m, prompt = _model_and_prompt()
    set_weights(m, fmt)
    ar, _, _ = _run(m, prompt, DecodeConfig(mode="ar", max_new_tokens=N))
    credits = []
    credit = Ledger.credit
    monkeypatch.setattr(Ledger, "credit", lambda self, gain: (credits.append(gain), credit(self, gain))[1])
    out, _, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, funds=0.0)
    assert out == ar
    assert any(g > 0 for g in credits)
    assert sum(v for k, v in st.plan_hist.items() if k.startswith("lookup")) > st.plan_hist["ar"], dict(st.plan_hist)
