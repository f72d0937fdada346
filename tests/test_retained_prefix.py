"""A finished sequence's K/V stay in a free cache row (`BatchKVCache.retain`), so the next prompt
that starts alike (a chat's next turn: the history, then the new message) copies them instead of
running them again: bitwise the K/V its own prefill writes, in the exact formats, whatever layout
wrote them (AR steps, verified trees, lookup chains), and every output equals AR's."""

import pytest
import torch

from selfspec.engine.forward.cache import BatchKVCache
from selfspec.engine.schedule.decoder import Decoder, generate_ids
from selfspec.engine.measure.formats import set_weights
from selfspec.engine.request.options import DecodeConfig

from conftest import tiny_model
from matrix import EXACT

V = 16
LAYOUTS = [dict(mode="ar"), dict(block_length=4, budget=6), dict(mode="lookup"),
           dict(mode="presto", schedule="one-pass", block_length=4, budget=6)]
_M = {}


def _model(fmt):
    if fmt not in _M:
        _M[fmt] = set_weights(tiny_model(seed=2, vocab_size=V), fmt)
    return _M[fmt]


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, V, (n,), generator=g).tolist()


class Prefills:
    """Wraps a decoder's forward: the [rows, width] of every causal (prefill) forward."""

    def __init__(self, dec):
        self.bf, self.seen = dec.stepper.bf, []
        dec.stepper.bf = self

    def __call__(self, tokens, *a, causal=False, **kw):
        if causal:
            self.seen.append(tuple(tokens.shape))
        return self.bf(tokens, *a, causal=causal, **kw)

    def __getattr__(self, name):
        return getattr(self.bf, name)


def _kv(dec, row, n):
    return [(k[row, :, :n].clone(), v[row, :, :n].clone()) for k, v in zip(dec.cache.k, dec.cache.v)]


def _alone_kv(m, prompt):
    dec = Decoder(m, [prompt], DecodeConfig(mode="ar", max_new_tokens=2), eos_token_id=[])
    next(iter(dec.turn()))
    return _kv(dec, 0, len(prompt))


def _same(a, b):
    return all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q)) and len(a) == len(b)


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["ar", "auto", "lookup", "presto-one-pass"])
def test_a_chats_next_turn_copies_the_history_a_finished_answer_left_in_its_row(fmt, layout):
    """Turn 1 (a 20-token prompt) is answered and finishes; its row's K/V (prompt and answer, as
    the rounds of this layout wrote them) move to the cache's free row. Turn 2 (turn 1's prompt,
    its answer, and 5 new tokens) copies all of that and prefills only what the cache lacked: its
    K/V equal its lone prefill's bit for bit and its answer equals AR's."""
    m = _model(fmt)
    m.__dict__.pop("_selfspec_planners", None)
    cfg = DecodeConfig(max_new_tokens=10, **layout)
    first = _tokens(20, seed=1)
    dec = Decoder(m, [first], cfg, batch_size=2, eos_token_id=[])
    dec.reserve(prompt_tokens=40, max_new_tokens=10)  # both rows now, as a server does
    for _ in dec:
        pass
    answer = dec.outputs[0]
    held = dec.cache.retained
    assert list(held.values()) == [(first + answer)[: len(next(iter(held.values())))]]
    kept = len(next(iter(held.values())))
    assert kept >= len(first)
    second = first + answer + _tokens(5, seed=2)
    w = Prefills(dec)
    seq = dec.add(second)
    dec.step()
    assert w.seen == [(1, len(second) - kept)], (w.seen, kept)  # only what the cache lacked
    r, n = dec.scheduler.live.index(seq), len(second)
    assert _same(_kv(dec, r, n), _alone_kv(m, second))
    for _ in dec:
        pass
    ar = DecodeConfig(mode="ar", max_new_tokens=10)
    assert dec.outputs[seq.index] == generate_ids(m, second, ar, eos_token_id=[])[0]


def test_a_retained_row_taken_by_a_new_sequence_is_given_up_and_nothing_is_copied_from_it():
    """Two prompts take both rows, the retained one included: it is no donor any more, and a
    later prompt that starts like the finished one prefills whole and still decodes AR's tokens."""
    m = _model("int4")
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    first = _tokens(20, seed=1)
    dec = Decoder(m, [first], cfg, batch_size=2, eos_token_id=[])
    dec.reserve(prompt_tokens=40, max_new_tokens=10)  # both rows now, as a server does
    for _ in dec:
        pass
    assert dec.cache.retained
    others = [_tokens(9, seed=3), _tokens(7, seed=4)]
    for p in others:
        dec.add(p)
    dec.step()
    assert not dec.cache.retained
    for _ in dec:
        pass
    again = first + _tokens(3, seed=5)
    w = Prefills(dec)
    seq = dec.add(again)
    for _ in dec:
        pass
    assert sum(r * c for r, c in w.seen) >= len(again)
    assert dec.outputs[seq.index] == generate_ids(m, again, cfg, eos_token_id=[])[0]
    assert all(dec.outputs[i] == generate_ids(m, p, cfg, eos_token_id=[])[0] for i, p in zip((1, 2), others))


def test_fp32_rows_retain_nothing():
    """fp32 rows are not bitwise width-invariant: a copy would not be the row's own prefill."""
    m = tiny_model(seed=2, vocab_size=V)
    dec = Decoder(m, [_tokens(20, seed=1)], DecodeConfig(mode="ar", max_new_tokens=4), batch_size=2, eos_token_id=[])
    dec.reserve(prompt_tokens=40, max_new_tokens=10)
    for _ in dec:
        pass
    assert dec.cache.retained == {}


def test_retain_takes_the_row_it_extends_else_the_highest_free_one_else_the_oldest():
    """The docstring's example, then a third row's tokens with no free row left but the retained
    ones: the oldest gives way. A claimed row retains nothing."""
    c = BatchKVCache(["cpu"], 1, 2, 4, 8, torch.float32)
    c.retains = True
    with torch.inference_mode():
        for r in range(4):
            c.k[0][r] = float(r + 1)
    c.lengths[:2] = [3, 4]
    c.retain(0, [5, 6, 7], free=2)
    assert c.retained == {3: [5, 6, 7]} and c.lengths[3] == 3 and torch.all(c.k[0][3, :, :3] == 1)
    c.retain(1, [5, 6, 7, 8], free=2)
    assert c.retained == {3: [5, 6, 7, 8]} and torch.all(c.k[0][3, :, :4] == 2)
    c.retain(1, [9, 9, 9, 9], free=2)
    assert c.retained == {3: [5, 6, 7, 8], 2: [9, 9, 9, 9]}
    c.lengths[0] = 3
    c.retain(0, [1, 2, 3], free=2)
    assert c.retained == {2: [9, 9, 9, 9], 3: [1, 2, 3]}
    c.claim(0, 3)
    assert c.retained == {3: [1, 2, 3]} and c.lengths[2] == 0


def test_a_second_request_through_the_server_reuses_the_first_ones_text_and_answers_as_generate():
    """Through the HTTP server (int8, two rows): a ~300-token prompt is answered; then a request
    whose prompt is that prompt, its answer and a few more words is prefilled in one forward of
    what the cache lacked (its whole prompt would take three 128-token pieces), and its answer
    equals `selfspec.generate`'s."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import selfspec
    from test_server import MODEL, LiveServer, int8_code_prompt

    model, tok, first = int8_code_prompt(300)
    srv = LiveServer(model, tok, max_batch=2, max_queue=2)
    try:
        def ask(prompt):
            got, stats = "", {}
            for chunk in srv.client().completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                         stream=True):
                got += chunk.choices[0].text if chunk.choices else ""
                stats = getattr(chunk, "selfspec", None) or stats
            return got, stats

        answer, stats1 = ask(first)
        second = first + answer + "\n\ndef g(y):\n"
        got, stats2 = ask(second)
    finally:
        srv.close()
    assert len(tok.encode(second)) > 2 * 128
    assert stats1["prefill_forwards"] >= 3 and stats2["prefill_forwards"] == 1, (stats1, stats2)
    assert got == selfspec.generate(model, tok, second, max_new_tokens=16).text


_MT = {}


def _text_model(fmt):
    """A tiny model over the byte tokenizer's 261 ids, in weight format `fmt`."""
    if fmt not in _MT:
        m = tiny_model(seed=3, vocab_size=261)
        _MT[fmt] = m if fmt == "fp32" else set_weights(m, fmt)
    return _MT[fmt]


def _prefilled(monkeypatch) -> list[int]:
    """Every prefill forward's prompt tokens from now on (`Prefill._forward`), in a list."""
    from selfspec.engine.schedule.prefill import Prefill

    seen, real = [], Prefill._forward

    def spy(self, seqs, slot, widths):
        seen.append(sum(widths))
        return real(self, seqs, slot, widths)

    monkeypatch.setattr(Prefill, "_forward", spy)
    return seen


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("layout", LAYOUTS[:2] + LAYOUTS[3:], ids=["ar", "auto", "presto-one-pass"])
def test_a_generation_continued_with_past_prefills_only_what_its_cache_lacked_and_equals_a_fresh_one(
        fmt, layout, monkeypatch):
    """Turn 1: a 150-token prompt, 12 new tokens at most. Turn 2 (turn 1's prompt, its answer and
    10 more tokens) with past=turn 1 continues in turn 1's cache: it prefills at most those 10 and
    the answer's last token (which turn 1 never ran), a fresh generation all of it, and both give
    the same tokens. Then a third turn continues the second."""
    import selfspec
    from test_streaming import TOK

    m = _text_model(fmt)
    m.__dict__.pop("_selfspec_planners", None)
    kw = dict(max_new_tokens=12, eos_token_id=[], **layout)
    p1 = TOK.encode("def f(x):\n    return x\n" * 6 + "def g(y):\n")[:150]
    g1 = selfspec.generate(m, TOK, p1, **kw)
    p2 = p1 + g1.token_ids + TOK.encode("\nclass A:\n")
    seen = _prefilled(monkeypatch)
    g2 = selfspec.generate(m, TOK, p2, past=g1, **kw)
    continued, seen[:] = sum(seen), []
    fresh = selfspec.generate(m, TOK, p2, **kw)
    assert sum(seen) == len(p2) and 1 <= continued <= len(p2) - len(p1) - len(g1.token_ids) + 1, (sum(seen), continued)
    assert g2.token_ids == fresh.token_ids
    p3 = p2 + g2.token_ids + TOK.encode("\n# end\n")
    seen[:] = []
    g3 = selfspec.generate(m, TOK, p3, past=g2, **kw)
    assert sum(seen) <= len(p3) - len(p2) - len(g2.token_ids) + 1
    assert g3.token_ids == selfspec.generate(m, TOK, p3, **kw).token_ids


def test_past_in_fp32_starts_afresh_and_gives_the_same_tokens(monkeypatch):
    import selfspec
    from test_streaming import TOK

    m = _text_model("fp32")
    p1 = TOK.encode("import os\n" * 16)
    g1 = selfspec.generate(m, TOK, p1, max_new_tokens=6, mode="ar", eos_token_id=[])
    p2 = p1 + g1.token_ids + TOK.encode("\n")
    seen = _prefilled(monkeypatch)
    g2 = selfspec.generate(m, TOK, p2, past=g1, max_new_tokens=6, mode="ar", eos_token_id=[])
    assert sum(seen) == len(p2)
    assert g2.token_ids == selfspec.generate(m, TOK, p2, max_new_tokens=6, mode="ar", eos_token_id=[]).token_ids


def test_a_bad_past_is_one_clear_error_before_any_work():
    import selfspec
    from test_streaming import TOK

    m, other = _text_model("int8"), _text_model("int4")
    kw = dict(max_new_tokens=4, mode="ar", eos_token_id=[])
    g1 = selfspec.generate(m, TOK, "abc" * 10, **kw)
    with pytest.raises(TypeError, match="past must be a Generation"):
        selfspec.stream(m, TOK, "abc", past="abc", **kw)
    with pytest.raises(ValueError, match="one conversation"):
        selfspec.stream(m, TOK, ["abc", "def"], past=g1, **kw)
    with pytest.raises(ValueError, match="another model"):
        selfspec.stream(other, TOK, "abc", past=g1, **kw)
    with pytest.raises(ValueError, match="has not run"):
        selfspec.stream(m, TOK, "abc", past=selfspec.stream(m, TOK, "abc", **kw), **kw)
    selfspec.generate(m, TOK, "abc" * 11, past=g1, **kw)
    with pytest.raises(ValueError, match="continued already"):
        selfspec.stream(m, TOK, "abc", past=g1, **kw)


def test_the_chat_command_continues_each_turn_in_the_previous_ones_cache(monkeypatch):
    """`selfspec chat` passes each turn's generation as the next turn's past; /reset starts afresh."""
    import io

    from selfspec.tools import chat

    seen = []

    def turn(model, tok, messages, out, past=None, **kw):
        seen.append(past)
        messages.append({"role": "assistant", "content": "ok"})
        return f"gen{len(seen)}"

    monkeypatch.setattr(chat, "chat_turn", turn)
    tok = type("T", (), {"chat_template": "x"})()
    chat.run_chat(None, tok, inp=io.StringIO("a\nb\n/reset\nc\nd\n"), out=io.StringIO(), err=io.StringIO())
    assert seen == [None, "gen1", None, "gen3"]


def test_the_same_prompt_again_with_past_runs_its_last_token_and_answers_the_same(monkeypatch):
    """Regenerating an answer: the prompt is all in the cache, yet its last token runs again (its
    hidden state gives the first new token); the answer equals the first one."""
    import selfspec
    from test_streaming import TOK

    m = _text_model("int8")
    p = TOK.encode("import sys\n" * 4)
    g1 = selfspec.generate(m, TOK, p, max_new_tokens=8, mode="ar", eos_token_id=[])
    seen = _prefilled(monkeypatch)
    g2 = selfspec.generate(m, TOK, p, past=g1, max_new_tokens=8, mode="ar", eos_token_id=[])
    assert seen == [1] and g2.token_ids == g1.token_ids


def test_a_sampled_continuation_with_past_draws_what_its_seed_draws_afresh():
    """Same bits in the cache, same logits: a seeded sample continued with past= equals the fresh
    one token for token (and is a sample, not the greedy answer)."""
    import selfspec
    from test_streaming import TOK

    m = _text_model("w4a8")
    kw = dict(max_new_tokens=16, eos_token_id=[], temperature=1.5, seed=3, block_length=4, budget=6)
    p1 = TOK.encode("for i in range(10):\n" * 3)
    g1 = selfspec.generate(m, TOK, p1, **kw)
    p2 = p1 + g1.token_ids + TOK.encode("\n")
    g2 = selfspec.generate(m, TOK, p2, past=g1, **kw)
    fresh = selfspec.generate(m, TOK, p2, **kw)
    assert g2.token_ids == fresh.token_ids
    assert fresh.token_ids != selfspec.generate(m, TOK, p2, max_new_tokens=16, eos_token_id=[]).token_ids


@pytest.mark.parametrize("fmt", ["int4", "w4a8"])
@pytest.mark.parametrize("layout", [dict(mode="ar"), dict(block_length=4, budget=6)], ids=["ar", "auto"])
def test_many_conversations_arriving_and_leaving_at_random_each_answer_as_alone(fmt, layout, monkeypatch):
    """Three rows, 24 requests added over time at random: most continue an earlier request's
    prompt and answer (a chat's next turn), the others start anew, some are cancelled midway; rows
    are retained, claimed, copied from and moved in whatever order that brings (a few prefixes
    are copied, most continued requests find their turn evicted by then). Every request that ran
    to its end answers what it answers alone (greedy: AR's tokens)."""
    import random

    m = _model(fmt)
    m.__dict__.pop("_selfspec_planners", None)
    cfg = DecodeConfig(max_new_tokens=8, **layout)
    rng = random.Random(5)
    dec = Decoder(m, [], cfg, batch_size=3, eos_token_id=[])
    dec.reserve(prompt_tokens=120, max_new_tokens=8)
    prefilled = _prefilled(monkeypatch)
    done, seqs, cancelled = [], [], set()
    for t in range(150):
        if len(seqs) < 24 and rng.random() < 0.2:
            if done and rng.random() < 0.7:
                base = rng.choice(done)
                prompt = (base.prompt + base.emitted)[:100] + _tokens(rng.randint(1, 5), seed=t)
            else:
                prompt = _tokens(rng.randint(17, 30), seed=100 + t)
            seqs.append(dec.add(prompt))
        running = [s for s in seqs if not s.done]
        if running and rng.random() < 0.08:
            victim = rng.choice(running)
            dec.cancel(victim)
            cancelled.add(victim.index)
        dec.step()
        done = [s for s in seqs if s.done and s.index not in cancelled]
    for _ in dec:
        pass
    finished = [s for s in seqs if s.index not in cancelled]
    assert len(finished) >= 15 and dec.cache.retained
    assert sum(prefilled) < sum(len(s.prompt) for s in seqs) - 3 * 16  # prefixes were copied, not run
    ar = DecodeConfig(mode="ar", max_new_tokens=8)
    for s in finished:
        assert s.emitted == generate_ids(m, s.prompt, ar, eos_token_id=[])[0], s.index


def test_of_two_threads_continuing_one_past_at_once_one_takes_its_cache_and_the_other_is_refused():
    import threading

    import selfspec
    from test_streaming import TOK

    m = _text_model("int8")
    kw = dict(max_new_tokens=4, mode="ar", eos_token_id=[])
    g1 = selfspec.generate(m, TOK, "abc" * 10, **kw)
    start, got = threading.Barrier(2), []

    def go():
        start.wait()
        try:
            got.append(selfspec.stream(m, TOK, "abc" * 11, past=g1, **kw))
        except ValueError as e:
            got.append(str(e))

    threads = [threading.Thread(target=go) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(type(x).__name__ for x in got) == ["Generation", "str"] and "continued already" in str(got)


@pytest.mark.parametrize("fmt", ["int4", "w4a8"])
def test_prompts_entering_together_sorted_by_length_never_start_in_a_row_another_one_holds(fmt):
    """Nothing runs; row 1 retained a finished turn. Two prompts enter together, the longer one
    first: the next turn of that conversation (shorter) and an unrelated prompt. They are
    prefilled shortest first, so rows are claimed after that order is known: the unrelated
    prompt, now in row 1, starts empty, not at the other's prefix; both answer as alone."""
    m = _model(fmt)
    cfg = DecodeConfig(mode="ar", max_new_tokens=6)
    first = _tokens(20, seed=1)
    dec = Decoder(m, [first], cfg, batch_size=2, eos_token_id=[])
    dec.reserve(prompt_tokens=60, max_new_tokens=6)
    for _ in dec:
        pass
    assert 1 in dec.cache.retained
    other = _tokens(40, seed=6)
    nxt = first + dec.outputs[0] + _tokens(3, seed=7)
    seqs = [dec.add(other), dec.add(nxt)]
    for _ in dec:
        pass
    ar = DecodeConfig(mode="ar", max_new_tokens=6)
    assert [s.emitted for s in seqs] == [generate_ids(m, p, ar, eos_token_id=[])[0] for p in (other, nxt)]
