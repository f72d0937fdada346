"""One round loop: a generation of one prompt is the batch decoder with one row, and what the
batch-1 path had (the batch-1 planner, the round hook, the recorder, learned rho) runs per row in
a batch."""

import collections

import pytest
import torch

from selfspec.engine.batch import BatchDecoder, generate_batch_ids
from selfspec.engine.batch_planner import BatchPlanner
from selfspec.engine.decoder import Decoder, generate_ids
from selfspec.engine.options import DecodeConfig
from selfspec.engine.planner import Planner
from selfspec.engine.profile import CostProfile

from conftest import tiny_model

from test_batch import MODES, V

LAYOUTS = {**MODES, "auto": dict(mode="auto", block_length=6, budget=8)}


def _prompts(lengths=(3, 17, 9, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, V, (n,), generator=g).tolist() for n in lengths]


def _fake_clock(monkeypatch):
    """plan "auto" reads round times: 1 ms per clock reading makes two runs see the same times."""
    import types

    from selfspec.engine import batch as batch_mod

    ticks = iter(range(10**9))
    monkeypatch.setattr(batch_mod, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks) * 1e-3))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_prompt_is_the_batch_round_with_one_row(layout, monkeypatch):
    """The batch-1 API and a batch of one prompt are the same run: tokens, rounds, layouts and
    query tokens agree, and the decoder holds one cache row."""
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=30, **LAYOUTS[layout])
    kw = dict(profile=CostProfile.flat()) if layout == "auto" else {}
    for p in _prompts():
        m.__dict__.pop("_selfspec_planners", None)  # auto: both runs start from the same planner
        _fake_clock(monkeypatch)
        dec = Decoder(m, p, cfg, eos_token_id=[], **kw)
        out = [t for chunk in dec for t in chunk]
        assert isinstance(dec.engine, BatchDecoder) and dec.engine.cache.rows == 1
        m.__dict__.pop("_selfspec_planners", None)
        _fake_clock(monkeypatch)
        outs, stats = generate_batch_ids(m, [p], cfg, eos_token_id=[], batch_size=4, **kw)
        assert outs == [out]
        a, b = dec.stats, stats[0]
        assert (a.accept_lengths, a.forwards, a.query_tokens, a.plan_hist) == \
            (b.accept_lengths, b.forwards, b.query_tokens, b.plan_hist)


def test_plan_auto_uses_the_batch1_planner_for_one_row_and_the_batch_planner_for_several():
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=8)
    one = BatchDecoder(m, _prompts()[:2], cfg, batch_size=1, profile=CostProfile.flat())
    assert isinstance(one.planner, Planner) and one.batch_planner is None
    from selfspec.engine.batch_profile import BatchProfile

    many = BatchDecoder(m, _prompts()[:2], cfg, batch_size=2, profile=BatchProfile.flat())
    assert isinstance(many.batch_planner, BatchPlanner) and many.planner is None


def test_the_profile_given_picks_the_planner_and_a_mismatch_fails_before_any_work(tmp_path, monkeypatch):
    from selfspec.engine.batch_profile import BatchProfile

    m = tiny_model(vocab_size=V)
    prompts = _prompts()[:2]
    cfg = DecodeConfig(max_new_tokens=12)
    path = tmp_path / "batch.json"
    BatchProfile.flat().save(str(path))
    for prof in (BatchProfile.flat(), str(path)):  # a batch profile for one row: the batch planner plans
        dec = BatchDecoder(m, prompts, cfg, batch_size=1, profile=prof)
        assert dec.planner is None and isinstance(dec.batch_planner, BatchPlanner)
    ar = [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=12), eos_token_id=[])[0] for p in prompts]
    assert generate_batch_ids(m, prompts, cfg, batch_size=1, eos_token_id=[], profile=str(path))[0] == ar
    monkeypatch.setattr(BatchDecoder, "_prefill", lambda *a: pytest.fail("model work before the error"))
    with pytest.raises(ValueError, match="batch cost profile"):
        BatchDecoder(m, prompts, cfg, batch_size=2, profile=CostProfile.flat())


def test_one_row_plan_auto_reaches_one_pass_trees_and_stays_exact():
    """A flat profile makes big trees with groups pay: the batch-1 planner picks one-pass
    layouts, which only it can; the output is still AR's."""
    m = tiny_model(vocab_size=V)
    prompts = _prompts()
    m.__dict__.pop("_selfspec_planners", None)
    outs, stats = generate_batch_ids(m, prompts, DecodeConfig(max_new_tokens=40, block_length=6, budget=8),
                                     eos_token_id=[], batch_size=1, profile=CostProfile.flat())
    ar = [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0] for p in prompts]
    assert outs == ar
    hist = sum((s.plan_hist for s in stats), start=collections.Counter())
    assert any(k.startswith("one-pass") for k in hist), hist


@pytest.mark.parametrize("layout", ["presto two-pass", "presto one-pass", "lookup"])
def test_batch_round_hook_reports_each_row_as_its_batch1_run(layout):
    """on_round in a batch: one dict per row and round, tagged with the row; each row's rounds
    commit what its batch-1 rounds commit, and their tokens are the row's output."""
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=24, **LAYOUTS[layout])
    prompts = _prompts()
    dec = BatchDecoder(m, prompts, cfg, batch_size=3, eos_token_id=[])
    seen = collections.defaultdict(list)
    dec.on_round = lambda info: seen[info["row"]].append(info)
    for _ in dec:
        pass
    assert sorted(seen) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        one = Decoder(m, p, cfg, eos_token_id=[])
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
    gens = generate(m, TOK, prompts, max_new_tokens=12, mode="presto", budget=6, block_length=5, eos_token_id=[],
                    trace=True)
    for p, g in zip(prompts, gens):
        one = generate(m, TOK, p, max_new_tokens=12, mode="presto", budget=6, block_length=5, eos_token_id=[],
                       trace=True)
        assert [r.committed for r in g.trace.rounds] == [r.committed for r in one.trace.rounds]
        assert g.trace is not None and g.trace.token_ids == g.token_ids
        assert len(g.trace.rounds) == g.stats.rounds and "<html" in g.trace.to_html()[:200].lower()


def test_the_recorder_sees_every_row_that_verified_a_drafted_tree():
    m = tiny_model(vocab_size=V)
    cfg = DecodeConfig(max_new_tokens=20, **LAYOUTS["presto two-pass"])
    prompts = _prompts()
    dec = BatchDecoder(m, prompts, cfg, batch_size=2, eos_token_id=[])
    calls = []
    dec.recorder = lambda tree, lq, tok, targets, entropy, history, rho, logits: calls.append(
        (len(tree), targets.shape[0], entropy is not None, logits.shape))
    for _ in dec:
        pass
    expected = 0
    for p in prompts:
        one = Decoder(m, p, cfg, eos_token_id=[])
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


def test_the_batch_planner_is_told_when_the_batch_drains(monkeypatch):
    """While prompts wait for a cache row the planner counts the batch's tokens; once none waits
    it gets every row's tokens left (the batch now ends with its slowest row)."""
    from selfspec.engine.batch_profile import BatchProfile

    seen, real = [], BatchPlanner.plan

    def plan(self, chains, matches, room, *, drain=None):
        seen.append(drain)
        return real(self, chains, matches, room, drain=drain)

    monkeypatch.setattr(BatchPlanner, "plan", plan)
    m = tiny_model(vocab_size=V)
    prompts = _prompts((3, 17, 9, 6))
    dec = BatchDecoder(m, prompts, DecodeConfig(max_new_tokens=10), batch_size=2, eos_token_id=[],
                       profile=BatchProfile.flat())
    for _ in dec:
        pass
    first_drain = next(i for i, d in enumerate(seen) if d is not None)
    assert first_drain > 0 and all(d is not None for d in seen[first_drain:])
    assert all(len(d) <= 2 and all(1 <= x <= 9 for x in d) for d in seen[first_drain:])
