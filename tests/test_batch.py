"""Batched decoding: every row equals its batch-1 run (greedy), every row is an exact,
reproducible sample (sampled), and no row ever reads another row's or a stale slot.

Rows are ragged: prompt lengths differ by more than a round's width, rows accept different
lengths every round, rows finish early (eos inside an accepted span) and waiting prompts take
their cache row (continuous batching)."""

import random

import pytest
import torch

from selfspec.engine.schedule.decoder import Decoder, generate_batch_ids
from selfspec.engine.forward.batch_forward import BatchForward
from selfspec.engine.forward.masks import batch_mask
from selfspec.engine.forward.masks import rows_layout
from selfspec.drafting.tree import chain
from selfspec.engine.schedule.decoder import generate_ids
from selfspec.engine.forward.forward import FastForward
from selfspec.engine.request.options import DecodeConfig

from conftest import OneRow, tiny_model

V = 8
MODES = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup"),
    "linear two-pass": dict(mode="linear", schedule="two-pass", block_length=8),
    "presto two-pass": dict(mode="presto", schedule="two-pass", block_length=8, budget=16),
    "linear one-pass": dict(mode="linear", schedule="one-pass", block_length=8, group_nodes=2),
    # groups on 3 of 9 nodes: endpoints without a group read their nearest owner's, shifted
    "presto one-pass": dict(mode="presto", schedule="one-pass", block_length=4, budget=8, group_nodes=3),
}
_M = {}


def _model(seed=0):
    if seed not in _M:
        _M[seed] = tiny_model(seed=seed, vocab_size=V)
    return _M[seed]


def _prompts(lengths=(3, 25, 10, 7, 14, 5), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, V, (n,), generator=g).tolist() for n in lengths]


def _batch1(m, prompts, cfg, **kw):
    return [generate_ids(m, p, cfg, **kw) for p in prompts]


# -- the batched forward -----------------------------------------------------------------------------
def test_a_padded_row_block_and_the_batch_mask():
    blk = rows_layout([chain([5, 6])], [None], 1, mask_id=4, width=3).blocks[0]  # a chain of 2, padded to 3
    assert (blk == 0).tolist() == [[True, False, False], [True, True, False], [False, False, True]]
    m = batch_mask([1, 3], torch.stack([blk, blk]), torch.float32)
    assert m.shape == (2, 1, 3, 6)
    seen = (m[:, 0] == 0)
    # row 0: slot 0 (prefix), its block at slots 1..3, nothing at 4, 5 (stale for this row)
    assert seen[0].tolist() == [[True, True, False, False, False, False], [True, True, True, False, False, False],
                                [True, False, False, True, False, False]]
    assert seen[1].tolist() == [[True, True, True, True, False, False], [True, True, True, True, True, False],
                                [True, True, True, False, False, True]]


def _poison(cache, value=1e30):
    """Every slot at or past its row's length: huge finite K and V (unmasked, they would dominate)."""
    with torch.inference_mode():
        for bufs in (cache.k, cache.v):
            for buf in bufs:
                for r, n in enumerate(cache.lengths):
                    buf[r, :, n:] = value


def test_batched_forward_rows_equal_the_batch1_forward_with_poisoned_free_slots():
    m = tiny_model()
    bf, one = BatchForward(FastForward(m)), OneRow(m)  # one cache row: the batch-1 path, with no padding
    prompts = [list(range(5, 5 + n)) for n in (3, 19, 6)]
    cache = bf.new_cache(3, 48)
    _poison(cache)
    refs = []
    for r, p in enumerate(prompts):
        bf(torch.tensor([p]), torch.arange(len(p))[None], cache, slice(r, r + 1), causal=True)
        cache.set_length(r, len(p))
        c1 = one.new_cache(48)
        one(torch.tensor(p), torch.arange(len(p)), c1, causal=True)
        c1.commit(0, list(range(len(p))))
        refs.append(c1)
    _poison(cache)
    # a 3-node tree (root, two children) and a padded row
    block = torch.tensor([[0.0, -1e9, -1e9], [0.0, 0.0, -1e9], [0.0, -1e9, 0.0]]).masked_fill(
        torch.tensor([[False, True, True], [False, False, True], [False, True, False]]), float("-inf"))
    blocks = torch.stack([block, block, rows_layout([chain([13])], [None], 1, mask_id=4, width=3).blocks[0]])
    toks = torch.tensor([[7, 8, 9], [10, 11, 12], [13, 0, 0]])
    offs = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 2]])
    h = bf(toks, offs, cache, slice(0, 3), block=blocks)
    assert torch.isfinite(h).all()
    for r in range(3):
        n = 3 if r < 2 else 1
        h1 = one(toks[r, :n], offs[r, :n], refs[r], block=blocks[r, :n, :n])
        torch.testing.assert_close(h[r, :n], h1, rtol=1e-5, atol=1e-5)


# -- greedy: each row equals its batch-1 run ----------------------------------------------------------------
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_rows_equal_batch1(mode):
    """Prompt lengths 3..25 (more than a round's width apart), 6 prompts through 4 cache rows,
    in input order and shuffled."""
    m = _model()
    cfg = DecodeConfig(max_new_tokens=30, **MODES[mode])
    prompts = _prompts()
    refs = _batch1(m, prompts, cfg, eos_token_id=[])
    outs, stats = generate_batch_ids(m, prompts, cfg, eos_token_id=[], batch_size=4)
    assert outs == [r[0] for r in refs]
    assert [s.accept_lengths for s in stats] == [r[1].accept_lengths for r in refs]
    if mode != "ar":  # the comparison could have failed: rows accepted drafts, by different amounts
        assert sum(a > 1 for s in stats for a in s.accept_lengths) >= 6
        assert len({tuple(s.accept_lengths) for s in stats}) > 1
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    shuffled, _ = generate_batch_ids(m, [prompts[i] for i in order], cfg, eos_token_id=[], batch_size=3)
    assert shuffled == [refs[i][0] for i in order]


def test_one_pass_rows_read_their_own_next_marginals():
    """Trees of different sizes in one round (groups on 2 nodes: short chains after an unowned
    endpoint): every row's acceptance equals batch-1's, so each read its own group's marginals."""
    m = _model(2)
    cfg = DecodeConfig(max_new_tokens=30, **MODES["linear one-pass"])
    prompts = _prompts((3, 25, 10, 7, 14, 5))
    refs = _batch1(m, prompts, cfg, eos_token_id=[])
    outs, stats = generate_batch_ids(m, prompts, cfg, eos_token_id=[], batch_size=4)
    assert outs == [r[0] for r in refs]
    assert [s.accept_lengths for s in stats] == [r[1].accept_lengths for r in refs]
    assert sum(a > 1 for s in stats for a in s.accept_lengths) >= 2


@pytest.mark.parametrize("mode", ["linear two-pass", "presto one-pass"])
def test_draft_lora_runs_on_draft_rows_only_as_in_batch1(mode):
    """The adapter on every projection plus the mask embedding (as the shipped one): batched drafts
    are the batch-1 drafts, so the accept lengths match round for round."""
    from selfspec.checkpoint.lora import TARGETS, DraftLoRA, module_of

    m = tiny_model(seed=2, vocab_size=V)
    g = torch.Generator().manual_seed(0)
    weights = {}
    for i, layer in enumerate(m.encoder.layers):
        for name in TARGETS:
            out_f, in_f = module_of(layer, name).weight.shape
            weights[(i, name)] = (torch.randn(2, in_f, generator=g), torch.randn(out_f, 2, generator=g) * 0.3)
    emb = torch.randn(m.config.hidden_size, generator=g)
    m.draft_lora = DraftLoRA(m, weights, scale=0.5, mask_embedding=emb)
    cfg = DecodeConfig(max_new_tokens=20, **MODES[mode])
    prompts = _prompts((3, 12, 7), seed=4)
    refs = _batch1(m, prompts, cfg, eos_token_id=[])
    outs, stats = generate_batch_ids(m, prompts, cfg, eos_token_id=[], batch_size=2)
    ar = _batch1(m, prompts, DecodeConfig(mode="ar", max_new_tokens=20), eos_token_id=[])
    assert outs == [r[0] for r in refs] == [r[0] for r in ar]
    assert [s.accept_lengths for s in stats] == [r[1].accept_lengths for r in refs]
    off = DecodeConfig(max_new_tokens=20, draft_lora=False, **MODES[mode])  # the adapter changes the drafts
    assert [s.accept_lengths for s in generate_batch_ids(m, prompts, off, eos_token_id=[], batch_size=2)[1]] != \
        [s.accept_lengths for s in stats]


@pytest.mark.parametrize("profile,spec", [("flat", True), ("steep", False)])
def test_plan_auto_in_a_batch_equals_ar_and_follows_the_batch_cost(profile, spec, monkeypatch):
    """On a clock where every forward takes what the cost model says: with flat (GPU-like) costs
    the planner speculates on this repetitive tiny model; with costs that grow with every query
    token it keeps AR apart from its probes. Either way every row equals its batch-1 AR output."""
    import types

    from selfspec.engine.round import step as step_mod
    from selfspec.engine.forward.batch_forward import BatchForward
    from selfspec.engine.measure.cost import CostModel

    prof = CostModel.flat() if profile == "flat" else CostModel.linear(per_token=1.0, fixed=1.0)
    clock = [0.0]
    real_call = BatchForward.__call__

    def timed_call(self, tokens, *args, **kw):
        clock[0] += prof(int(tokens.shape[0]), int(tokens.shape[1]))
        return real_call(self, tokens, *args, **kw)

    monkeypatch.setattr(BatchForward, "__call__", timed_call)
    monkeypatch.setattr(step_mod, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    m = _model()
    prompts = _prompts((4, 9, 3, 12))
    outs, stats = generate_batch_ids(m, prompts, DecodeConfig(max_new_tokens=40, block_length=8), eos_token_id=[],
                                     profile=prof)
    assert outs == [r[0] for r in _batch1(m, prompts, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])]
    hist = sum((s.plan_hist for s in stats), start=__import__("collections").Counter())
    spec_rounds = sum(v for k, v in hist.items() if k != "ar")
    if spec:
        assert spec_rounds > hist["ar"], hist
        assert sum(a > 1 for s in stats for a in s.accept_lengths) >= 8
    else:
        assert hist["ar"] > 3 * spec_rounds, hist


def _eos_inside_span(out_no_eos, accept_lengths, eos):
    """True when the first `eos` of the run is not the last token of its round's chunk."""
    if eos not in out_no_eos[1:] or eos == out_no_eos[0]:  # token 0 is the prefill's, a chunk of its own
        return False
    at, end = out_no_eos.index(eos), 1  # the prefill chunk is token 0
    for a in accept_lengths:
        if at < end + a:
            return at != end + a - 1
        end += a
    return False


# (lookup shares the walk and the emit path; on these prompts its first eos never falls inside a span)
@pytest.mark.parametrize("mode", ["linear two-pass", "presto two-pass", "presto one-pass"])
def test_a_row_finishing_on_eos_inside_an_accepted_span_leaves_while_others_go_on(mode):
    m = _model()
    cfg = DecodeConfig(max_new_tokens=30, **MODES[mode])
    prompts = _prompts()
    free = _batch1(m, prompts, cfg, eos_token_id=[])
    # an eos token that ends some row inside an accepted span while another row goes on past it
    def first(o, t):
        return o.index(t) if t in o else len(o)

    eos = next(t for t in range(V) if any(_eos_inside_span(o, st.accept_lengths, t)
                                          and any(first(o2, t) > first(o, t) for o2, _ in free) for o, st in free))
    refs = _batch1(m, prompts, cfg, eos_token_id=eos)
    dec = Decoder(m, prompts, cfg, eos_token_id=eos, batch_size=4)
    events = list(dec)
    assert dec.outputs == [r[0] for r in refs]
    longest = max(len(o) for o in dec.outputs)
    assert any(len(o) < longest and o[-1] == eos for o in dec.outputs)
    # chunks arrive per row in order and add up to the row's output
    for i in range(len(prompts)):
        assert [t for r, c in events if r == i for t in c] == dec.outputs[i]


def test_continuous_batching_rows_move_into_freed_cache_rows(monkeypatch):
    """The long row (the longest prompt, so the last cache row: prompts entering together take rows
    shortest first, and 30 new tokens against the others' 6) outlives the rows before it: when they
    finish and no prompt waits, it moves into a freed cache row and goes on from there."""
    from selfspec.engine.forward.cache import BatchKVCache
    from selfspec.engine.request.sequence import SamplingParams

    moves = []
    real = BatchKVCache.move
    monkeypatch.setattr(BatchKVCache, "move", lambda self, src, dst: (moves.append((src, dst)), real(self, src, dst)))
    m = _model()
    cfg = DecodeConfig(max_new_tokens=30, **MODES["linear two-pass"])
    prompts = _prompts((25, 10, 7, 3))
    params = [SamplingParams(max_new_tokens=n) for n in (30, 6, 6, 6)]
    refs = [generate_ids(m, p, DecodeConfig(max_new_tokens=q.max_new_tokens, **MODES["linear two-pass"]),
                         eos_token_id=[]) for p, q in zip(prompts, params)]
    for bs in (1, 2, 3, 4):
        moves.clear()
        outs, _ = generate_batch_ids(m, prompts, cfg, eos_token_id=[], batch_size=bs, params=params)
        assert outs == [r[0] for r in refs], bs
        if bs == 4:  # rows 0..2 finish first with nothing waiting: row 3 moves down
            assert moves and moves[0][0] == 3, moves


def test_continuous_batching_with_rows_that_finish_at_their_prefill_token():
    m = _model()
    cfg = DecodeConfig(max_new_tokens=6, **MODES["presto two-pass"])
    prompts = _prompts((3, 25, 10, 7))
    eos = _batch1(m, prompts[:1], cfg, eos_token_id=[])[0][0][0]  # row 0's prefill token
    refs = _batch1(m, prompts, cfg, eos_token_id=eos)
    assert len(refs[0][0]) == 1  # row 0 finishes at its prefill token
    for bs in (1, 2, 3):
        outs, _ = generate_batch_ids(m, prompts, cfg, eos_token_id=eos, batch_size=bs)
        assert outs == [r[0] for r in refs], bs


@pytest.mark.parametrize("mode", ["lookup", "presto two-pass", "presto one-pass"])
def test_stale_and_foreign_slots_are_never_read(mode):
    """Free slots (past each row's length, and cache rows no live row holds) are filled with huge
    values before every forward; the outputs do not move."""
    m = _model()
    cfg = DecodeConfig(max_new_tokens=30, **MODES[mode])
    prompts = _prompts()
    clean, _ = generate_batch_ids(m, prompts, cfg, eos_token_id=[], batch_size=4)
    dec = Decoder(m, prompts, cfg, eos_token_id=[], batch_size=4)
    real = dec.stepper.bf.__call__
    calls = []

    def poisoned(tokens, offsets, cache, rows, **kw):
        _poison(cache)
        calls.append(rows)
        return real(tokens, offsets, cache, rows, **kw)

    dec.stepper.bf = type("Poisoned", (), {"__call__": staticmethod(poisoned), "logits": dec.bf.logits, "joins": dec.bf.joins})()
    for _ in dec:
        pass
    assert len(calls) > 12 and dec.outputs == clean


# -- sampled: exact, reproducible rows ------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["ar", "lookup", "presto two-pass", "presto one-pass"])
def test_sampled_rows_are_reproducible_and_equal_their_batch1_draws(mode):
    m = _model(2)
    cfg = DecodeConfig(max_new_tokens=12, temperature=1.0, **MODES[mode])
    prompts = _prompts((4, 11, 6), seed=3)
    a = generate_batch_ids(m, prompts, cfg, eos_token_id=[], seeds=[10, 11, 12])[0]
    b = generate_batch_ids(m, prompts, cfg, eos_token_id=[], seeds=[10, 11, 12], batch_size=2)[0]
    c = generate_batch_ids(m, prompts, cfg, eos_token_id=[], seeds=[20, 21, 22])[0]
    assert a == b and a != c
    # each row draws with its own generator exactly as the batch-1 decoder does
    ref = [generate_ids(m, p, cfg, eos_token_id=[], generator=torch.Generator().manual_seed(s))[0]
           for p, s in zip(prompts, (10, 11, 12))]
    assert a == ref


@pytest.mark.parametrize("mode", ["ar", "presto two-pass", "presto one-pass"])
def test_sampled_rows_follow_the_exact_ar_distribution(mode):
    """300 rows of one prompt (seeds 0..299, 100 cache rows) against the enumerated AR marginals."""
    from test_sampled_exactness import NEW, PROMPT, chi2, critical, exact_marginals

    m = tiny_model(seed=2, vocab_size=V)
    kw = dict(MODES[mode], block_length=4, budget=8, tree_top_k=3, group_nodes=None) if mode != "ar" else MODES[mode]
    cfg = DecodeConfig(max_new_tokens=NEW, temperature=1.0, **kw)
    N = 300
    outs, stats = generate_batch_ids(m, [PROMPT] * N, cfg, eos_token_id=[], seeds=list(range(N)), batch_size=100)
    outs = torch.tensor(outs)
    exact = exact_marginals(m, PROMPT, NEW)
    wrong = exact_marginals(m, PROMPT, NEW, temperature=0.5)
    for k in range(NEW):
        counts = torch.bincount(outs[:, k], minlength=V).float()
        stat, df = chi2(counts, exact[k], N)
        assert stat < critical(df, checks=NEW), (k, stat, df)
    counts = torch.bincount(outs[:, 2], minlength=V).float()
    assert chi2(counts, wrong[2], N)[0] > critical(chi2(counts, wrong[2], N)[1], checks=NEW)  # the test can reject
    if mode != "ar":  # deep tree nodes were drawn from
        assert sum(s.accept_lengths[0] >= 2 for s in stats) > N // 4


# -- bad input: clear errors before any model work -----------------------------------------------------------
@pytest.mark.parametrize("prompts,kw,msg", [
    ([], {}, "empty batch"),
    ([[5, 6], []], {}, "empty prompt at index 1"),
    ([[5, 6], [7]], dict(seeds=[1]), "1 per-row generators / seeds for 2 prompts"),
    ([[5, 6], [7]], dict(batch_size=0), "batch_size must be"),
    ([[5, 6], [7]], dict(max_cache_bytes=1000), "KV cache"),
    ([[5, 6], [7]], dict(cfg=DecodeConfig(mode="presto", rho="learned")), "learned"),
    ([[5, 6], [7] * 300], {}, "max_position_embeddings"),
])
def test_bad_batches_fail_before_any_model_work(prompts, kw, msg, monkeypatch):
    def boom(*a, **k):
        raise AssertionError("model work")

    monkeypatch.setattr(BatchForward, "__call__", boom)
    cfg = kw.pop("cfg", DecodeConfig(mode="ar", max_new_tokens=8))
    with pytest.raises(ValueError, match=msg):
        Decoder(_model(), prompts, cfg, **kw)


# -- the public API: generate / stream with a list of prompts ------------------------------------------------
@pytest.fixture(scope="module")
def byte_model():
    return tiny_model(seed=1, vocab_size=261)


def test_generate_a_list_of_prompts_returns_one_result_per_prompt_in_order(byte_model):
    from test_streaming import TOK

    from selfspec import generate, stream

    prompts = ["def f(x):\n", "import os", "x = [1, 2, 3]\nfor i in x:\n    "]
    kw = dict(max_new_tokens=12, mode="lookup", eos_token_id=[])
    res = generate(byte_model, TOK, prompts, batch_size=2, **kw)
    assert [r.prompt_ids for r in res] == [TOK.encode(p) for p in prompts]
    for p, r in zip(prompts, res):
        one = generate(byte_model, TOK, p, **kw)
        assert (r.token_ids, r.text, r.finish_reason) == (one.token_ids, one.text, "length")
        assert r.stats.new_tokens == 12 and r.stats.rounds == one.stats.rounds
    deltas = {}
    for row, d in stream(byte_model, TOK, prompts, **kw):
        deltas[row] = deltas.get(row, "") + d
    assert [deltas.get(i, "") for i in range(3)] == [r.text for r in res]
    # eos: the row that meets it stops with finish_reason "eos"
    eos = res[1].token_ids[3]
    res_eos = generate(byte_model, TOK, prompts, **{**kw, "eos_token_id": eos})
    assert res_eos[1].finish_reason == "eos"
    assert res_eos[1].token_ids == res[1].token_ids[: res[1].token_ids.index(eos) + 1]


def test_batch_seeds_int_means_seed_plus_row_and_a_list_gives_one_per_row(byte_model):
    from test_streaming import TOK

    from selfspec import generate

    prompts = ["ab", "cd", "ef"]
    kw = dict(max_new_tokens=8, mode="ar", temperature=1.0, eos_token_id=[])
    a = [r.token_ids for r in generate(byte_model, TOK, prompts, seed=7, **kw)]
    b = [r.token_ids for r in generate(byte_model, TOK, prompts, seed=[7, 8, 9], **kw)]
    one = [generate(byte_model, TOK, p, seed=7 + i, **kw).token_ids for i, p in enumerate(prompts)]
    assert a == b == one


@pytest.mark.parametrize("prompts,kw,msg", [
    ([], {}, "empty batch"),
    (["ab", ""], {}, "empty prompt"),
    (["ab", []], {}, "prompt 1: empty prompt"),
    (["ab", "cd"], dict(seed=[1, 2, 3]), "3 seeds for 2 prompts"),
    (["ab", "cd"], dict(max_cache_bytes=1000), "KV cache"),
    (["ab", "cd"], dict(batch_size=0), "batch_size"),
    (["ab", "cd"], dict(stop=[""]), "stop strings must be non-empty"),
    (["ab", "cd"], dict(generator=torch.Generator()), "generator= is one prompt's"),
    (["ab", "cd"], dict(mode="ar", profile="x.json"), "plan 'auto' only"),
    (["ab", "cd"], dict(mode="presto", rho="learned"), "learned"),
    (["ab", "cd"], dict(bogus=1), "unknown decoding option"),
])
def test_bad_batch_requests_fail_in_stream_before_any_model_work(byte_model, prompts, kw, msg, monkeypatch):
    from test_streaming import TOK

    from selfspec import stream

    def boom(*a, **k):
        raise AssertionError("model work")

    monkeypatch.setattr(BatchForward, "__call__", boom)
    with pytest.raises(ValueError, match=msg):
        stream(byte_model, TOK, prompts, max_new_tokens=8, **{"mode": "ar", **kw})


def test_stop_strings_end_each_row_of_a_batch_on_its_own(byte_model):
    """A row that hits a stop string leaves the batch (its text ends before the stop string);
    the other rows go on to their own end and equal their runs alone."""
    from test_streaming import TOK

    from selfspec import generate

    prompts = ["def f(x):\n", "import os", "class A:"]
    free = [generate(byte_model, TOK, p, max_new_tokens=16, mode="ar", eos_token_id=[]) for p in prompts]
    t = free[0].text
    stop = next(t[i:i + 2] for i in range(2, len(t) - 2) if t[i:i + 2] not in free[1].text + free[2].text
                and t[i:i + 2] not in t[:i + 1])
    res = generate(byte_model, TOK, prompts, max_new_tokens=16, mode="ar", eos_token_id=[], stop=stop, batch_size=2)
    assert res[0].finish_reason == "stop_string" and res[0].text == free[0].text[: free[0].text.index(stop)]
    assert [r.text for r in res[1:]] == [g.text for g in free[1:]]
    assert [r.finish_reason for r in res[1:]] == ["length", "length"]


def test_cli_generate_batch_writes_one_json_record_per_prompt(tiny_dir, tmp_path, capsys):
    import json

    from selfspec.tools.cli import main

    prompts = ["def f(x):\n", {"prompt": "import os"}, "x = 1"]
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    common = ["--model", str(tiny_dir), "--max-new-tokens", "6", "--mode", "lookup", "--json"]
    assert main(["generate", "--prompt-file", str(pf), "--batch-size", "2", *common]) == 0
    recs = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()]
    assert [r["index"] for r in recs] == [0, 1, 2]
    for p, r in zip(["def f(x):\n", "import os", "x = 1"], recs):
        assert main(["generate", "--prompt", p, *common]) == 0
        one = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert (r["token_ids"], r["text"], r["new_tokens"]) == (one["token_ids"], one["text"], 6)
    pf.write_text('"ok"\n\"\"\n')
    assert main(["generate", "--prompt-file", str(pf), "--batch-size", "2", *common]) == 2
    assert "line 2: empty prompt" in capsys.readouterr().err


def test_cli_batch_reads_a_cost_model_for_plan_auto_and_refuses_one_for_a_fixed_mode(tiny_dir, tmp_path, capsys):
    import json

    from selfspec.engine.measure.cost import CostModel
    from selfspec.tools.cli import main

    pf = tmp_path / "prompts.jsonl"
    pf.write_text("\n".join(json.dumps(p) for p in ["def f(x):\n", "x = 1", "import os"]) + "\n")
    prof = tmp_path / "batch.json"
    CostModel.flat().save(str(prof))
    common = ["--model", str(tiny_dir), "--prompt-file", str(pf), "--batch-size", "2", "--max-new-tokens", "8", "--json"]
    assert main(["generate", *common, "--profile", str(prof)]) == 0
    recs = [json.loads(ln) for ln in capsys.readouterr().out.strip().splitlines()]
    assert len(recs) == 3 and all(sum(r["plan_hist"].values()) == r["rounds"] for r in recs)
    assert main(["generate", *common, "--profile", str(prof), "--mode", "ar"]) == 2
    assert "--plan auto only" in capsys.readouterr().err
    prof.write_text("{}")
    assert main(["generate", *common, "--profile", str(prof)]) == 2
    assert "cost model" in capsys.readouterr().err
