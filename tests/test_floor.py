"""plan "auto" is never much slower than AR: on a fake clock that prices every forward by a
CPU-like cost model, drafts that are never accepted cost auto at most 3% of AR's time, drafts
that are always accepted make it speculate, and a planner whose ledger ignores its losses
fails the first."""

import pytest
import torch

from selfspec.drafting.tree import Tree
from selfspec.engine.planning import round_costs as ledger_mod
from selfspec.engine.planning import planner as planner_mod
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.schedule.decoder import Decoder, generate_ids
from selfspec.engine.planning.round_costs import Ledger
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.request.sequence import lookup_chain

from conftest import FakeClock, PricedForward, tiny_model
from matrix import FORMATS_KV8, set_weights

# a CPU: 2 query tokens cost 1.15 AR steps, 5 cost 2, a mask group of 8 with its tree ~3-4
CPU = CostModel.one_row((1, 2, 4, 5, 8, 16, 64, 256), ((1e-2, 1.15e-2, 1.3e-2, 2e-2, 2.5e-2, 3.5e-2, 9e-2, 0.3),))
N = 240  # new tokens


def _model_and_prompt():
    m = tiny_model(seed=3, vocab_size=16, max_position_embeddings=512,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 64.0,
                                    "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1})
    prompt = torch.randint(5, 16, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    return m, prompt


def _run(m, prompt, cfg, reference=None, accept=None, stall=0.0, learning=0.0, drag=0.0, chains=None, funds=None):
    """(token ids, fake seconds) of one generation. `accept`: every drafted token is replaced by the
    reference's token at its position (True: always accepted) or by another one (False: never);
    `chains`: every context-lookup chain is the reference's next 10 tokens after a 3-token match
    (True: a text that repeats itself) or 10 other tokens (False); by default as `accept` says
    (every drafted token: verified, or followed in hindsight, a chain is right or wrong alike);
    "context": the context's own chains, followed in hindsight as they are but verified as
    `accept` says (hindsight that the real rounds do not bear out); `funds`: the ledger's funds
    at the generation's start (a planner whose earlier answers left it none);
    `stall`: seconds the first forecast takes on top of its own (a garbage collection's pause);
    `learning`: seconds the planner takes to observe a round it forecast (AR mode's rounds do not);
    `drag`: seconds a forward takes beyond its price when a forecast ran before it in its round."""
    m.__dict__.pop("_selfspec_planners", None)  # a fresh planner: nothing learnt by another test
    dec = Decoder(m, [prompt], cfg, eos_token_id=[], profile=CPU)
    clock = FakeClock()
    dec.stepper.clock = clock
    dec.bf = dec.stepper.bf = PricedForward(dec.stepper.bf, clock, CPU)
    if accept is not None:
        ref = torch.tensor(reference + [5] * 64)
        draft = dec.stepper.draft

        def rigged(rnd):
            draft(rnd)
            for r in rnd.rows:
                if len(r.tree) > 1:
                    right = ref[r.emitted_before + r.tree.depths[1:] - 1]
                    tokens = r.tree.tokens.clone()
                    tokens[1:] = right if accept else 5 + (right - 4) % 11  # another id of 5..15
                    r.tree = Tree(tokens, r.tree.parents, r.tree.depths, r.tree.scores)

        dec.stepper.draft = rigged
    chains = accept if chains is None else None if chains == "context" else chains
    if chains is not None:
        ref_list = reference + [5] * 64

        def chain(seq, cfg, room):
            seq.match = 3
            right = ref_list[len(seq.emitted): len(seq.emitted) + min(10, room - 1)]
            return right if chains else [5 + (t - 4) % 11 for t in right]

        planner_mod.lookup_chain = chain
    if funds is not None:
        begin = dec.planner.begin
        dec.planner.begin = lambda: (begin(), setattr(dec.planner.ledger, "funds", funds))
    if stall:
        forecast = dec.planner.forecast

        def stalled(r):
            clock.t += stall if not stalled.done else 0.0
            stalled.done = True
            return forecast(r)

        stalled.done = False
        dec.planner.forecast = stalled
    if learning:
        observe = dec.planner.observe

        def slow(rnd):
            clock.t += 0.0 if rnd.bare else learning
            observe(rnd)

        dec.planner.observe = slow
    if drag:
        forecast, pending = dec.planner.forecast, []

        def forecasting(r):
            pending.append(1)
            return forecast(r)

        class Dragged(PricedForward):
            def __call__(self, *a, **kw):
                self.clock.t += drag if pending else 0.0
                pending.clear()
                return super().__call__(*a, **kw)

        dec.planner.forecast = forecasting
        dec.bf = dec.stepper.bf = Dragged(dec.bf.bf, clock, CPU)
    try:
        for _ in dec:
            pass
    finally:
        planner_mod.lookup_chain = lookup_chain
    return dec.outputs[0], clock.t, dec.stats[0]


@pytest.fixture(scope="module")
def setting():
    m, prompt = _model_and_prompt()
    ar, ar_seconds, _ = _run(m, prompt, DecodeConfig(mode="ar", max_new_tokens=N))
    return m, prompt, ar, ar_seconds


def test_drafts_never_accepted_cost_auto_at_most_3_percent_of_ar(setting):
    m, prompt, ar, ar_seconds = setting
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, accept=False)
    assert out == ar
    assert seconds <= 1.03 * ar_seconds, (seconds / ar_seconds, dict(st.plan_hist))
    assert sum(v for k, v in st.plan_hist.items() if k != "ar") > 0  # it did try


def test_drafts_always_accepted_make_auto_speculate_and_beat_ar(setting):
    m, prompt, ar, ar_seconds = setting
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, accept=True)
    assert out == ar
    assert st.plan_hist["ar"] < st.rounds / 2, dict(st.plan_hist)
    assert seconds < 0.7 * ar_seconds, seconds / ar_seconds


def test_the_planners_learning_after_a_round_is_charged_to_speculation_too(setting):
    # observing a forecast round costing 5% of an AR round, outside the round's own clock: were it
    # not charged, forecasts that never pay would run ~every round and lose ~5%
    m, prompt, ar, ar_seconds = setting
    learning = 0.05 * CPU(1, 1, len(prompt))
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, accept=False,
                            learning=learning)
    assert out == ar
    assert seconds <= 1.03 * ar_seconds, (seconds / ar_seconds, dict(st.plan_hist))


def test_a_forward_slowed_by_the_forecast_before_it_is_charged_to_speculation(setting):
    # on a Xeon, an AR forward after a forecast's Python ran 0.1-0.2 ms (~5%) slower than a bare
    # one; priced as AR's own forward, forecasts that never pay ran in a third of the rounds
    m, prompt, ar, ar_seconds = setting
    drag = 0.08 * CPU(1, 1, len(prompt))
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, accept=False, drag=drag)
    assert out == ar
    assert seconds <= 1.03 * ar_seconds, (seconds / ar_seconds, dict(st.plan_hist))


def test_a_planner_that_ignores_its_losses_fails_the_floor(setting, monkeypatch):
    # where hindsight says the context's chains win and every verification rejects them: only the
    # ledger's measure of real rounds stops the bets
    m, prompt, ar, ar_seconds = setting
    monkeypatch.setattr(Ledger, "may_bet", lambda self, loss, lookup=False: True)
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, accept=False,
                            chains="context")
    assert out == ar
    assert seconds > 1.03 * ar_seconds, (seconds / ar_seconds, dict(st.plan_hist))


def test_one_stall_in_a_forecast_does_not_end_the_betting(setting):
    # 50 AR rounds of pause in the first forecast (a full GC collection among torch's objects):
    # charged whole it would leave the ledger 50 rounds in debt and no bet would follow
    m, prompt, ar, ar_seconds = setting
    stall = 50 * CPU(1, 1, len(prompt))
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, accept=True, stall=stall)
    assert out == ar
    assert st.plan_hist["ar"] < st.rounds / 2, dict(st.plan_hist)
    assert seconds - stall < 0.7 * ar_seconds, (seconds - stall) / ar_seconds


def test_one_stalled_ar_forward_moves_the_time_scale_as_a_round_pause_times_slower_would():
    # charged whole, a 30x stall would price AR 3.9x dearer for the rounds to come, and drafts that
    # are never accepted would look like wins
    from selfspec.engine.round.rounds import AR
    from selfspec.engine.planning.planner import Planner, Seen
    from selfspec.engine.planning.round_costs import EMA

    pl = Planner(CPU, DecodeConfig(max_new_tokens=N))
    predicted = CPU(1, 1, 64)

    def ar_round(factor):
        return Seen(AR, rows=1, width=1, cache_len=64, model_seconds=factor * predicted, seconds=factor * predicted,
                    plan_seconds=0.0, bare=True, draining=False, value=1.0)

    pl.costs.observe(ar_round(1.0))
    pl.costs.observe(ar_round(30.0))
    assert pl.costs.scale["ar"] == pytest.approx(1.0 + EMA * (ledger_mod.PAUSE - 1.0))


def test_the_ledger_counts_a_stalled_round_at_pause_times_its_prediction():
    led = Ledger()
    led.record(committed=1.0, seconds=0.5, ar_seconds=0.01, bare=False, plan_seconds=0.2, expected=0.02)
    spent = ledger_mod.PAUSE * 0.02 / 0.01  # AR rounds: the prediction's PAUSE times, not 50
    assert led.funds == pytest.approx(ledger_mod.CREDIT + ledger_mod.EPS * spent + 1.0 - spent)
    assert led.plan_seconds == pytest.approx(ledger_mod.PLAN_EMA * ledger_mod.PAUSE * ledger_mod.PLAN_FIRST * 0.01)


def test_the_ledger_funds_bets_from_time_and_wins_and_stops_after_losses():
    led = Ledger()
    assert led.funds == ledger_mod.CREDIT and led.may_bet(1.0) and not led.may_bet(1.5)
    for _ in range(100):  # bare AR rounds: time accrues EPS of itself
        led.record(committed=1.0, seconds=0.01, ar_seconds=0.01, bare=True)
    assert led.funds == pytest.approx(ledger_mod.CREDIT + 100 * ledger_mod.EPS)
    gain = led.record(committed=1.0, seconds=0.04, ar_seconds=0.01, bare=False)  # a probe that bought nothing
    assert gain == pytest.approx(-3.0)
    assert led.funds == pytest.approx(ledger_mod.CREDIT + 104 * ledger_mod.EPS - 3.0) and not led.may_bet(0.5)
    for _ in range(10):  # lookup rounds that commit 3 tokens for 1.3 AR rounds' time
        led.record(committed=3.0, seconds=0.013, ar_seconds=0.01, bare=False)
    assert led.funds == pytest.approx(ledger_mod.CAP)  # wins fund bets, up to CAP
    assert led.won == pytest.approx(-3.0 + 10 * 1.7)


def test_forecasting_is_skipped_while_the_ledger_cannot_pay_for_it(setting):
    m, prompt, ar, _ = setting
    cfg = DecodeConfig(max_new_tokens=16, block_length=8)
    dec = Decoder(m, [prompt], cfg, eos_token_id=[], profile=CPU)
    begin = dec.planner.begin
    dec.planner.begin = lambda: (begin(), setattr(dec.planner.ledger, "funds", -5.0))  # in debt within the answer
    forecasts = []
    forecast = dec.planner.forecast
    dec.planner.forecast = lambda r: forecasts.append(1) or forecast(r)
    for _ in dec:
        pass
    assert dec.outputs[0] == ar[:16]
    assert forecasts == [] and set(dec.stats[0].plan_hist) == {"ar"}


def test_a_new_generation_starts_without_a_debt_and_keeps_what_was_won():
    # a probe lost at the end of one answer must not keep the next ones from every bet
    from selfspec.engine.planning.planner import Planner

    pl = Planner(CPU, DecodeConfig(max_new_tokens=N))
    for funds, start in ((ledger_mod.CAP, ledger_mod.CAP), (0.5, 0.5), (-4.5, 0.0)):
        pl.ledger.funds = funds
        pl.begin()
        assert pl.ledger.funds == start


def test_a_forecast_round_that_chose_ar_is_charged_its_planning_not_its_forwards_noise():
    # its forward is AR's own: one twice-slow forward (another process) is no loss of speculation's
    from selfspec.engine.round.rounds import AR
    from selfspec.engine.planning.planner import Planner, Seen

    pl = Planner(CPU, DecodeConfig(max_new_tokens=N))
    ar = pl.costs.seconds(AR, 1, 64)[1]
    for model_seconds, plan in ((ar, 0.0), (2 * ar, 0.02 * ar), (0.5 * ar, 0.02 * ar)):
        before = pl.ledger.funds
        pl.unsettled.append(Seen(AR, rows=1, width=1, cache_len=64, model_seconds=model_seconds,
                                 seconds=model_seconds + plan, plan_seconds=plan, bare=False, draining=False,
                                 value=1.0))
        pl.settle()
        spent = 1.0 + plan / pl.costs.seconds(AR, 1, 64)[1]  # the AR time as it stood when the round was accounted
        assert pl.ledger.funds == pytest.approx(before + ledger_mod.EPS * spent + 1.0 - spent), model_seconds / ar


# forecasting costs ~3% of an AR round in Python (a 1k-token context, 2-core Xeon): as much as the
# ledger's EPS adds, so a generation that starts without funds could never afford a lookup bet
PLANNING = 0.03


def test_hindsight_lets_a_generation_without_funds_bet_on_a_text_that_repeats_itself(setting):
    # the 1k-token edit prompt of the long suite: its answer looped, every chain right, and auto
    # ran 91 of 93 rounds AR (funds ~0.1 against a 3-token bet's 0.3 AR rounds)
    m, prompt, ar, ar_seconds = setting
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, chains=True, funds=0.0,
                            learning=PLANNING * CPU(1, 1, len(prompt)))
    assert out == ar
    first_bet = next(i for i, n in enumerate(st.accept_lengths) if n > 1)
    assert first_bet <= 8, st.accept_lengths[:40]  # without hindsight: after ~30 AR rounds of EPS
    assert seconds < 0.4 * ar_seconds, seconds / ar_seconds


def test_hindsight_of_chains_that_are_never_right_buys_no_bets(setting):
    m, prompt, ar, ar_seconds = setting
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, chains=False, funds=0.0,
                            learning=PLANNING * CPU(1, 1, len(prompt)))
    assert out == ar
    assert not any(k.startswith("lookup") for k in st.plan_hist), dict(st.plan_hist)
    assert seconds <= 1.03 * ar_seconds, seconds / ar_seconds


def test_hindsight_that_real_bets_do_not_bear_out_costs_at_most_twice_its_cap(setting):
    # each lookup bet it funded and lost empties it and halves what it may fund next
    m, prompt, ar, ar_seconds = setting
    out, seconds, st = _run(m, prompt, DecodeConfig(max_new_tokens=N, block_length=8), ar, accept=False,
                            chains="context")
    assert out == ar
    bound = 1.03 * ar_seconds + 2 * ledger_mod.SHADOW_CAP * CPU(1, 1, len(prompt) + N)
    assert seconds <= bound, (seconds / ar_seconds, dict(st.plan_hist))


def _after_switch(m, prompt, cfg, switch: float, reference=None):
    """(tokens, fake seconds a token after `switch`, the planner) of one generation on a machine that runs every
    forward at 2x its price until `switch` fake seconds and at its price after; with `reference`,
    every lookup chain is its next tokens before the switch (a text that repeats itself) and other
    tokens after."""
    m.__dict__.pop("_selfspec_planners", None)
    dec = Decoder(m, [prompt], cfg, eos_token_id=[], profile=CPU)
    clock = FakeClock()
    dec.stepper.clock = clock
    dec.bf = dec.stepper.bf = PricedForward(dec.stepper.bf, clock,
                                            lambda R, q, c: CPU(R, q, c) * (2.0 if clock.t < switch else 1.0))
    if reference is not None:
        ref = reference + [5] * 64

        def chain(seq, cfg, room):
            seq.match = 3
            right = ref[len(seq.emitted): len(seq.emitted) + min(10, room - 1)]
            return right if clock.t < switch else [5 + (t - 4) % 11 for t in right]

        planner_mod.lookup_chain = chain
    at = None
    try:
        for _ in dec:
            if at is None and clock.t >= switch:
                at = (clock.t, len(dec.outputs[0]))
    finally:
        planner_mod.lookup_chain = lookup_chain
    return dec.outputs[0], (clock.t - at[0]) / (len(dec.outputs[0]) - at[1]), dec.planner


@pytest.mark.parametrize("fmt", FORMATS_KV8)
def test_a_machine_that_gets_faster_while_auto_bets_leaves_no_stale_reference_behind(fmt):
    """Only bare AR rounds measure AR's time now, the floor's reference. Chains right while the
    machine runs at half speed: auto bets round after round, and runs no bare round; then the
    machine runs at full speed and the chains are wrong. A reference left at the slow speed priced
    the wrong chains as wins (0.86x AR after the switch); refreshed while betting (and the kinds'
    scales measured against the stale one re-based), auto stays within 5% of AR, and the lookup
    rounds' scale ends where the clock prices them: at AR's."""
    m, prompt = _model_and_prompt()
    m = set_weights(m, fmt)
    n = 400
    ar, ar_after, _ = _after_switch(m, prompt, DecodeConfig(mode="ar", max_new_tokens=n), 1.5)
    out, auto_after, planner = _after_switch(m, prompt, DecodeConfig(mode="auto", max_new_tokens=n), 1.5, reference=ar)
    assert out == ar
    assert ar_after / auto_after >= 0.95
    assert planner.costs.scale["ar"] == pytest.approx(1.0, abs=0.05) and planner.costs.relative["lookup"] == pytest.approx(1.0, abs=0.05)
