"""One decoder for one prompt or many: a scheduler (waiting and live rows, prefill, refill) and a
step (plan -> draft -> lay out + forward -> verify + commit -> observe) over one round object;
one planner for any number of rows; the hooks, the recorder and learned rho per row."""

import collections

import pytest
import torch

from selfspec.drafting.sampling import walk
from selfspec.engine.forward.cache import BatchKVCache
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.schedule.decoder import Decoder, generate_batch_ids, generate_ids
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.planning.planner import Planner
from selfspec.engine.schedule.prefill import Prefill

from conftest import tiny_model

from test_batch import MODES, V
from matrix import FORMATS_KV8, set_weights

LAYOUTS = {**MODES, "auto": dict(mode="auto", block_length=6, budget=8)}


def _prompts(lengths=(3, 17, 9, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, V, (n,), generator=g).tolist() for n in lengths]


def _fake_clock(monkeypatch):
    """plan "auto" reads round times: 1 ms per clock reading makes two runs see the same times."""
    import types

    from selfspec.engine.round import step as step_mod

    ticks = iter(range(10**9))
    monkeypatch.setattr(step_mod, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_prompt_alone_and_as_a_batch_of_one_are_the_same_run(layout, monkeypatch):
    """Tokens, accepted lengths, forwards, query tokens and layouts agree, and the decoder holds
    one cache row."""
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=30, **LAYOUTS[layout])
    kw = dict(profile=CostModel.flat()) if layout == "auto" else {}
    for p in _prompts():
        m.__dict__.pop("_selfspec_planners", None)  # auto: both runs start from the same planner
        _fake_clock(monkeypatch)
        dec = Decoder(m, p, cfg, eos_token_id=[], **kw)
        out = [t for _, chunk in dec for t in chunk]
        assert dec.cache.rows == 1
        m.__dict__.pop("_selfspec_planners", None)
        _fake_clock(monkeypatch)
        outs, stats = generate_batch_ids(m, [p], cfg, eos_token_id=[], batch_size=4, **kw)
        assert outs == [out]
        a, b = dec.stats[0], stats[0]
        assert (a.accept_lengths, a.forwards, a.query_tokens, a.plan_hist) == \
            (b.accept_lengths, b.forwards, b.query_tokens, b.plan_hist)


def test_one_planner_plans_one_row_and_many_and_reaches_one_pass_trees_in_both():
    """A flat cost model makes big trees with groups pay, for a single prompt and for a batch;
    the outputs are still AR's."""
    m = tiny_model(vocab_size=V)
    prompts = _prompts()
    ar = [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0] for p in prompts]
    for batch_size in (1, 3):
        m.__dict__.pop("_selfspec_planners", None)
        dec = Decoder(m, prompts, DecodeConfig(max_new_tokens=40, block_length=6, budget=8), eos_token_id=[],
                      batch_size=batch_size, profile=CostModel.flat())
        assert type(dec.planner) is Planner
        for _ in dec:
            pass
        assert dec.outputs == ar
        hist = sum((s.plan_hist for s in dec.stats), start=collections.Counter())
        assert any(k.startswith("one-pass") for k in hist), hist


def test_a_cost_model_for_another_device_fails_before_any_model_work(tmp_path, monkeypatch):
    m = tiny_model(vocab_size=V)
    path = tmp_path / "elsewhere.json"
    CostModel("cpu: elsewhere", "*", "any", "any", (1,), (1, 2), (0,), (((1.0, 2.0),),)).save(str(path))
    monkeypatch.setattr(Prefill, "whole", lambda *a: pytest.fail("model work before the error"))
    with pytest.raises(ValueError, match="measured for device"):
        Decoder(m, _prompts()[:2], DecodeConfig(max_new_tokens=12), batch_size=2, profile=str(path))


@pytest.mark.parametrize("layout", ["presto two-pass", "presto one-pass", "lookup", "linear one-pass"])
def test_a_step_commits_exactly_the_path_it_verified(layout, monkeypatch):
    """Every cache commit keeps the accepted path of that row's round, which the walk over its
    targets gives; nothing is committed before (or besides) the verification."""
    m = tiny_model(vocab_size=V)
    commits, real = [], BatchKVCache.commit
    monkeypatch.setattr(BatchKVCache, "commit", lambda self, row, acc: commits.append(list(acc)) or real(self, row, acc))
    dec = Decoder(m, _prompts(), DecodeConfig(max_new_tokens=20, **LAYOUTS[layout]), batch_size=2, eos_token_id=[])
    seen = []
    dec.on_round = lambda info: seen.append((info["path"], walk(info["tree"], info["targets"])[0]))
    for _ in dec:
        pass
    assert commits == [path for path, _ in seen] and all(path == walked for path, walked in seen)


def test_a_request_added_while_the_batch_runs_joins_at_the_next_turn():
    """A server adds requests to a running decoder: the new row is prefilled into a free cache
    row at the next turn and equals its run alone."""
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=16, mode="presto", schedule="one-pass", block_length=4, budget=6)
    a, b = _prompts((5, 30))
    dec = Decoder(m, [a], cfg, batch_size=2, eos_token_id=[])
    first = dec.step()  # a's prefill and first round
    assert [row for row, _ in first] == [0, 0]
    seq = dec.add(b)
    turn = dec.step()
    assert [row for row, _ in turn] == [1, 0, 1]  # b's prefill token, then a round over both rows
    for _ in dec:
        pass
    assert seq.done and dec.outputs[1] == generate_ids(m, b, cfg, eos_token_id=[])[0]
    assert dec.outputs[0] == generate_ids(m, a, cfg, eos_token_id=[])[0]


def test_requests_added_one_by_one_grow_the_cache_once_and_a_reserved_cache_not_at_all():
    """A burst of requests must not reallocate (and copy) the cache row by row: the second row
    added grows it straight to batch_size rows, and after `reserve` no add moves it at all."""
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=8, mode="lookup")
    prompts = _prompts((5, 9, 7, 12, 3))
    dec = Decoder(m, [], cfg, batch_size=5, eos_token_id=[])
    dec.add(prompts[0])
    dec.add(prompts[1])
    assert dec.cache.rows == 5
    reserved = Decoder(m, [], cfg, batch_size=5, eos_token_id=[])
    reserved.reserve(prompt_tokens=12, max_new_tokens=8)
    buffer = reserved.cache.k[0].data_ptr()
    for p in prompts:
        reserved.add(p)
    for _ in reserved:
        assert reserved.cache.k[0].data_ptr() == buffer
    assert reserved.outputs == [generate_ids(m, p, cfg, eos_token_id=[])[0] for p in prompts]
    with pytest.raises(ValueError, match="KV cache"):
        Decoder(m, [], cfg, batch_size=10**6, eos_token_id=[]).reserve(prompt_tokens=4000, max_new_tokens=90)


def test_a_cancelled_row_leaves_at_the_next_turn_and_the_others_go_on():
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=20, mode="lookup")
    prompts = _prompts((4, 9, 6))
    dec = Decoder(m, prompts, cfg, batch_size=3, eos_token_id=[])
    dec.step()
    assert dec.cancel(dec.sequences[1]) and not dec.cancel(dec.sequences[1])
    rows = [row for row, _ in dec.step()]
    assert 1 not in rows and len(dec.scheduler.live) == 2
    for _ in dec:
        pass
    ref = [generate_ids(m, p, cfg, eos_token_id=[])[0] for p in prompts]
    assert dec.outputs[0] == ref[0] and dec.outputs[2] == ref[2] and len(dec.outputs[1]) < 20


@pytest.mark.parametrize("layout", ["presto two-pass", "presto one-pass", "lookup"])
def test_batch_round_hook_reports_each_row_as_its_batch1_run(layout):
    """on_round in a batch: one dict per row and round, tagged with the row; each row's rounds
    commit what its batch-1 rounds commit, and their tokens are the row's output."""
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=24, **LAYOUTS[layout])
    prompts = _prompts()
    dec = Decoder(m, prompts, cfg, batch_size=3, eos_token_id=[])
    seen = collections.defaultdict(list)
    dec.on_round = lambda info: seen[info["row"]].append(info)
    for _ in dec:
        pass
    assert sorted(seen) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        one = Decoder(m, [p], cfg, eos_token_id=[])
        ref = []
        one.on_round = ref.append
        for _ in one:
            pass
        assert [r["committed"] for r in seen[i]] == [r["committed"] for r in ref]
        assert [r["round"] for r in seen[i]] == list(range(len(ref)))
        assert [r["c"] for r in seen[i]] == [r["c"] for r in ref]
        assert dec.outputs[i][1:] == [t for r in seen[i] for t in r["committed"]]


def test_batch_traces_one_per_row():
    from test_streaming import TOK

    from selfspec import generate

    m = tiny_model(seed=1, vocab_size=261)
    prompts = ["def f(x):\n", "import os"]
    gens = generate(m, TOK, prompts, max_new_tokens=12, mode="presto", schedule="one-pass", budget=6, block_length=5, eos_token_id=[],
                    trace=True)
    for p, g in zip(prompts, gens):
        one = generate(m, TOK, p, max_new_tokens=12, mode="presto", schedule="one-pass", budget=6, block_length=5, eos_token_id=[],
                       trace=True)
        assert [r.committed for r in g.trace.rounds] == [r.committed for r in one.trace.rounds]
        assert g.trace is not None and g.trace.token_ids == g.token_ids
        assert len(g.trace.rounds) == g.stats.rounds and "<html" in g.trace.to_html()[:200].lower()


def test_the_recorder_sees_every_row_that_verified_a_drafted_tree():
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=20, **LAYOUTS["presto two-pass"])
    prompts = _prompts()
    dec = Decoder(m, prompts, cfg, batch_size=2, eos_token_id=[])
    calls = []
    dec.recorder = lambda tree, lq, tok, targets, entropy, history, rho, logits: calls.append(
        (len(tree), targets.shape[0], entropy is not None, logits.shape))
    for _ in dec:
        pass
    expected = 0
    for p in prompts:
        one = Decoder(m, [p], cfg, eos_token_id=[])
        n = [0]
        one.recorder = lambda *a: n.__setitem__(0, n[0] + 1)
        for _ in one:
            pass
        expected += n[0]
    assert len(calls) == expected > 0
    assert all(n == t and ent and shape == (n, V) for n, t, ent, shape in calls)


@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
def test_learned_rho_in_a_batch_keeps_every_row_equal_to_batch1(schedule):
    from selfspec.drafting.learned_rho import Predictor

    m = tiny_model(vocab_size=V)
    torch.manual_seed(0)
    m.presto_predictor = Predictor().eval()
    cfg = DecodeConfig(mode="presto", schedule=schedule, rho="learned", block_length=6, budget=8, max_new_tokens=24)
    prompts = _prompts()
    outs, stats = generate_batch_ids(m, prompts, cfg, eos_token_id=[], batch_size=3)
    refs = [generate_ids(m, p, cfg, eos_token_id=[]) for p in prompts]
    assert outs == [r[0] for r in refs]
    assert [s.accept_lengths for s in stats] == [r[1].accept_lengths for r in refs]
    ar = [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=24), eos_token_id=[])[0] for p in prompts]
    assert outs == ar
    # the predictor reaches the rows' trees: the n-gram rho alone drafts differently
    ngram = generate_batch_ids(m, prompts, DecodeConfig(**{**cfg.__dict__, "rho": "ngram"}), eos_token_id=[],
                               batch_size=3)[1]
    assert [s.accept_lengths for s in ngram] != [s.accept_lengths for s in stats]


def test_the_planner_is_told_when_the_batch_drains(monkeypatch):
    """While prompts wait for a cache row the planner counts the batch's tokens; once none waits
    the round is worth the progress of the rows with the most tokens left."""
    seen, real = [], Planner.choose

    def choose(self, rows, cache, draining=False):
        seen.append((draining, [r.room for r in rows]))
        return real(self, rows, cache, draining)

    monkeypatch.setattr(Planner, "choose", choose)
    m = tiny_model(vocab_size=V)
    dec = Decoder(m, _prompts((3, 17, 9, 6)), DecodeConfig(max_new_tokens=10), batch_size=2, eos_token_id=[],
                  profile=CostModel.flat())
    dec.planner.ledger.may_bet = lambda loss, lookup=False: True  # every round planned: neither the floor (test_floor.py) nor a
    dec.planner.note_choice = lambda option: None  # rest after AR choices (timing-dependent) may skip it
    for _ in dec:
        pass
    first = next(i for i, (d, _) in enumerate(seen) if d)
    assert first > 0 and all(d for d, _ in seen[first:])
    assert all(len(rooms) <= 2 and all(1 <= x <= 9 for x in rooms) for _, rooms in seen[first:])


@pytest.mark.parametrize("fmt", FORMATS_KV8)
def test_auto_keeps_room_for_its_usual_rounds_and_grows_the_cache_for_a_wider_one(fmt):
    """Mode "auto" keeps the room its usual rounds take (a lookup chain, a probe's group, a draft
    pass), not the widest round it may choose; on flat costs it lays out trees with a group on
    every node, wider than that, the forward grows the cache first, and the tokens are AR's."""
    from selfspec.engine.request.request import ROUND_SCRATCH, round_room, scratch

    assert (round_room(DecodeConfig()), round_room(DecodeConfig(mode="ar")), round_room(DecodeConfig(mode="lookup"))) == (
        17, 1, 11)
    one_pass = DecodeConfig(mode="presto", schedule="one-pass")
    assert round_room(one_pass) == ROUND_SCRATCH < scratch(one_pass)
    m = set_weights(tiny_model(vocab_size=V), fmt)
    cfg = DecodeConfig(mode="auto", max_new_tokens=12, block_length=6, budget=8)
    prompts = _prompts((5, 9))
    dec = Decoder(m, prompts, cfg, batch_size=2, eos_token_id=[], profile=CostModel.flat())
    dec.planner.ledger.may_bet = lambda loss, lookup=False: True  # every round planned (not the floor's test)
    dec.planner.note_choice = lambda option: None
    dec.start()
    before = dec.cache.capacity
    assert before == 9 + 12 + round_room(cfg) + 1 and round_room(cfg) == 11 < scratch(cfg)
    assert dec.planner.costs.max_width == round_room(cfg)  # no round padded past the room: its own width only grows it
    widths = []
    dec.on_round = lambda info: widths.append(info["query_tokens"])
    for _ in dec:
        pass
    assert max(widths) > round_room(cfg) and dec.cache.capacity > before
    assert dec.outputs == [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=12), eos_token_id=[])[0]
                           for p in prompts]


def test_auto_prefills_a_mask_group_on_flat_costs_and_not_where_it_costs_many_ar_steps():
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(mode="auto", max_new_tokens=8, block_length=6, budget=8)
    steep = CostModel("synthetic", "*", "any", "any", (1,), (1, 2, 4, 6, 16, 64),
                      (0,), (((1e-3, 1.5e-3, 3e-3, 6e-3, 12e-3, 50e-3),),))
    counts = {}
    for name, profile in (("flat", CostModel.flat()), ("steep", steep)):
        m.__dict__.pop("_selfspec_planners", None)
        out, st = generate_ids(m, _prompts((7,))[0], cfg, eos_token_id=[], profile=profile)
        counts[name] = st.prefill_forwards
        assert out == generate_ids(m, _prompts((7,))[0], DecodeConfig(mode="ar", max_new_tokens=8), eos_token_id=[])[0]
    assert counts == {"flat": 2, "steep": 1}


def test_a_round_wider_than_the_reserved_scratch_grows_the_cache_and_stays_exact():
    """Rows keep ROUND_SCRATCH slots for a round; a one-pass tree with a group on every node
    needs more, and the forward grows the cache before it writes."""
    from selfspec.engine.request.request import ROUND_SCRATCH, scratch

    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=12, mode="presto", schedule="one-pass", block_length=8, budget=16)
    assert scratch(cfg) > ROUND_SCRATCH
    prompts = _prompts((5, 9))
    dec = Decoder(m, prompts, cfg, batch_size=2, eos_token_id=[])
    before = dec.cache.capacity if dec.cache is not None else None
    for _ in dec:
        pass
    assert before is None or dec.cache.capacity > before
    assert dec.cache.capacity >= max(map(len, prompts)) + scratch(cfg)
    assert dec.outputs == [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=12), eos_token_id=[])[0]
                           for p in prompts]
