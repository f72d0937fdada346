"""Chunked prefill: a prompt that joins running rows is prefilled a chunk per turn, the live rows'
round running every turn, and the K/V it writes is bitwise the one-forward prefill's (the formats
where a row's forward is width-invariant: int8, int4 and bf16 on the tiny models, see
test_invariance), so greedy output equals AR and every row equals its batch-1 run."""

import pytest
import torch

from selfspec.engine.measure.cost import CostModel
from selfspec.engine.forward.forward import FastForward
from selfspec.engine.schedule.decoder import Decoder, generate_ids
from selfspec.engine.schedule.prefill_rules import (PREFILL_CHUNK, PREFILL_OWN_ROUNDS, PREFILL_SHARE, prefill_first,
                                           prefill_groups, shared_prefixes, whole_prompts)
from selfspec.engine.planning.round_costs import PREFILL_FLOOR, PREFILL_WHOLE_ROUNDS, pick_chunk, token_price
from selfspec.engine.measure.formats import set_weights
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.request.sequence import SamplingParams

from conftest import FakeClock, PricedForward, tiny_model
from matrix import EXACT, FORMATS

V = 16
_M = {}


def _model(fmt):
    if fmt not in _M:
        _M[fmt] = set_weights(tiny_model(seed=2, vocab_size=V), fmt)
    return _M[fmt]


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, V, (n,), generator=g).tolist() for n in lengths]


class Widths:
    """Wraps a decoder's forward: the [rows, width] of every prompt chunk it runs (`seen`: in a
    causal forward of its own, or joined to a round's forward, `joined` counting those)."""

    def __init__(self, dec):
        self.bf, self.seen, self.joined = dec.stepper.bf, [], 0
        dec.stepper.bf = self

    def __call__(self, tokens, *a, causal=False, join=None, **kw):
        if causal:
            self.seen.append(tuple(tokens.shape))
        if join is not None:
            self.seen.append(tuple(join.tokens.shape))
            self.joined += 1
            return self.bf(tokens, *a, causal=causal, join=join, **kw)
        return self.bf(tokens, *a, causal=causal, **kw)

    def __getattr__(self, name):
        return getattr(self.bf, name)


def _join(m, cfg, running, joining, *, chunk, after=1, running_params=None, seen=None):
    """`running` prompts start; after `after` turns the `joining` ones are added (as a server
    does). Returns the decoder, each joining prompt's K/V [layers][kv, L, D] (k, v) read when its
    first token came, and how many tokens the running rows committed between the add and the
    joining prompts' first tokens."""
    dec = Decoder(m, running, cfg, batch_size=len(running) + len(joining), eos_token_id=[], prefill_chunk=chunk,
                  params=running_params)
    for _ in range(after):
        dec.step()
    seqs = [dec.add(p) for p in joining]
    if seen is not None:
        Widths(dec).seen = seen
    kv, between, waiting = {}, 0, {s.index for s in seqs}
    while dec.busy:
        for row, piece in dec.turn():
            if row in waiting:
                waiting.discard(row)
                r = dec.scheduler.live.index(dec.sequences[row]) if not dec.sequences[row].done else None
                if r is not None:
                    L = len(dec.prompts[row])
                    assert dec.cache.lengths[r] == L
                    kv[row] = [(k[r, :, :L].clone(), v[r, :, :L].clone()) for k, v in zip(dec.cache.k, dec.cache.v)]
            elif waiting and row < len(running):
                between += len(piece)
    return dec, [kv.get(s.index) for s in seqs], between


def _alone_kv(m, prompt):
    """The K/V the one-forward prefill of `prompt` writes (a lone generation's first turn)."""
    dec = Decoder(m, [prompt], DecodeConfig(mode="ar", max_new_tokens=2), eos_token_id=[])
    w = Widths(dec)
    next(iter(dec.turn()))
    assert w.seen == [(1, len(prompt))]  # the fast path: one forward
    L = len(prompt)
    return [(k[0, :, :L].clone(), v[0, :, :L].clone()) for k, v in zip(dec.cache.k, dec.cache.v)]


def _same_kv(a, b):
    return len(a) == len(b) and all(torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a, b))


@pytest.mark.parametrize("fmt", EXACT)
def test_a_long_prompt_joining_running_rows_is_prefilled_in_chunks_bitwise_as_in_one_forward(fmt):
    """A 70-token prompt joins two running rows with 8-token chunks: nine chunk forwards, the
    live rows commit tokens meanwhile, its cache row holds the one-forward prefill's K/V bit for
    bit, and every row's greedy output equals its run alone (= AR)."""
    m = _model(fmt)
    cfg = DecodeConfig(mode="ar", max_new_tokens=20)
    running, (long,) = _prompts((5, 9)), _prompts((70,), seed=1)
    dec, (kv,), between = _join(m, cfg, running, [long], chunk=8)
    assert kv is not None and _same_kv(kv, _alone_kv(m, long))
    assert dec.stats[2].prefill_forwards == 9  # ceil(70 / 8)
    assert between >= 8  # the live rows advanced while it was prefilled (a token per row per turn)
    assert list(dec.outputs) == [generate_ids(m, p, cfg, eos_token_id=[])[0] for p in running + [long]]


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("mode", [dict(mode="presto", schedule="one-pass", block_length=4, budget=6),
                                  dict(mode="linear", schedule="two-pass", block_length=6)])
def test_speculative_rows_and_several_joining_prompts_stay_exact(fmt, mode):
    """Three prompts join at once (40, 6 and 23 tokens, chunks of 16: the 40-token one's last 8
    and the 6-token one share a chunk forward) while a running row finishes mid-prefill (its row
    is freed and the prefilling rows move down); one-pass layouts take their first marginals with
    the last chunk. Every row equals its batch-1 run, which equals AR."""
    m = _model(fmt)
    cfg = DecodeConfig(max_new_tokens=16, **mode)
    running, joining = _prompts((6, 11)), _prompts((40, 6, 23), seed=3)
    params = [SamplingParams.of(cfg), SamplingParams(max_new_tokens=3)]  # row 1 leaves while the others prefill
    dec, kvs, between = _join(m, cfg, running, joining, chunk=16, running_params=params, seen=(seen := []))
    assert seen == [(1, 16), (1, 16), (2, 8), (1, 16), (1, 7)]
    assert all(_same_kv(kv, _alone_kv(m, p)) for kv, p in zip(kvs, joining))
    assert between > 0
    ar = DecodeConfig(mode="ar", max_new_tokens=16)
    assert dec.outputs[1] == generate_ids(m, running[1], DecodeConfig(mode="ar", max_new_tokens=3), eos_token_id=[])[0]
    assert [dec.outputs[i] for i in (0, 2, 3, 4)] == [generate_ids(m, p, ar, eos_token_id=[])[0]
                                                       for p in [running[0]] + joining]
    assert [dec.outputs[i] for i in (0, 2, 3, 4)] == [generate_ids(m, p, cfg, eos_token_id=[])[0]
                                                       for p in [running[0]] + joining]


def test_without_chunking_the_running_rows_wait_for_the_whole_prefill():
    """The contrast: a chunk as long as the prompt prefills it in the turn it joins (in that
    turn's round forward: the live rows get that one round's token before its first one); the
    default fixed chunk is PREFILL_CHUNK."""
    m = _model("int8")
    cfg = DecodeConfig(mode="ar", max_new_tokens=12)
    running, (long,) = _prompts((5, 9)), _prompts((70,), seed=1)
    dec, (kv,), between = _join(m, cfg, running, [long], chunk=70)
    assert between == len(running) and dec.stats[2].prefill_forwards == 1 and _same_kv(kv, _alone_kv(m, long))

    assert Decoder(m, running, cfg).scheduler.prefill.chunk_tokens() == PREFILL_CHUNK
    with pytest.raises(ValueError, match="prefill_chunk"):
        Decoder(m, running, cfg, prefill_chunk=0)


def test_a_lone_prompt_and_a_batch_entering_together_are_prefilled_whole_at_once():
    """With nothing running nobody waits: the fast path prefills whole prompts in the first turn,
    whatever the chunk; prompts of similar length share a forward, a short one is not padded to a
    long one's length (9 and 70 tokens: two forwards, shortest first; 9, 10 and 70: the two short
    ones together)."""
    m = _model("int8")
    cfg = DecodeConfig(mode="ar", max_new_tokens=4)
    for lengths, seen in (((70, 9), [(1, 9), (1, 70)]), ((70, 9, 10), [(2, 10), (1, 70)]), ((12,), [(1, 12)])):
        prompts = _prompts(lengths)
        dec = Decoder(m, prompts, cfg, eos_token_id=[], prefill_chunk=8)
        w = Widths(dec)
        for _ in dec:
            pass
        assert w.seen == seen
        assert list(dec.outputs) == [generate_ids(m, p, cfg, eos_token_id=[])[0] for p in prompts]


LAYOUTS = [dict(), dict(mode="presto", schedule="one-pass", block_length=4, budget=6), dict(mode="lookup")]


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("layout", LAYOUTS, ids=["auto", "presto-one-pass", "lookup"])
def test_a_burst_of_prompts_outnumbering_the_running_rows_is_prefilled_in_one_turn(fmt, layout):
    """One row runs and five prompts arrive at once (plan auto, chunks the decoder's to pick): they
    outnumber the running rows, so the next turn prefills all of them (shortest first, in forwards
    over rows of similar length) and every one has its first token after it, instead of a chunk
    a turn; each row still equals its run alone (= AR). A lone long prompt joining keeps to chunks."""
    m = _model(fmt)
    cfg = DecodeConfig(max_new_tokens=12, **layout)
    running, burst = _prompts((7,)), _prompts((30, 5, 28, 6, 31), seed=4)
    dec = Decoder(m, running, cfg, batch_size=6, eos_token_id=[])
    dec.step()
    seqs = [dec.add(p) for p in burst]
    w = Widths(dec)
    firsts = {row for row, _ in dec.step()}
    assert {s.index for s in seqs} <= firsts  # all five in one turn
    assert sum(r for r, _ in w.seen) == 5 and max(c for _, c in w.seen) == 31  # each prompt whole, in one forward
    while dec.busy:
        dec.step()
    ar = DecodeConfig(mode="ar", max_new_tokens=12)
    assert list(dec.outputs) == [generate_ids(m, p, ar, eos_token_id=[])[0] for p in running + burst]

    assert prefill_first(5, 1) and prefill_first(3, 2) and prefill_first(1, 0)  # with no row running, the rest at once
    assert not prefill_first(1, 1) and not prefill_first(1, 8)  # a prompt joining running rows: chunks


def test_prefill_groups_split_rows_where_padding_costs_more_than_a_forward():
    """The docstring's example, and the extremes: equal lengths share one forward; a forward that
    costs nothing beyond its tokens runs each row alone; one that costs a lot runs all together."""
    assert prefill_groups([10, 12, 40, 44], token_price) == [(0, 2), (2, 4)]
    assert prefill_groups([20, 20, 20], token_price) == [(0, 3)]
    assert prefill_groups([5, 10, 20], lambda r, w: r * w) == [(0, 1), (1, 2), (2, 3)]
    assert prefill_groups([5, 10, 20], lambda r, w: r * w + 1000) == [(0, 3)]
    assert prefill_groups([], token_price) == []


def test_auto_prefills_a_batch_in_the_forwards_ar_does_whatever_its_cost_model_says():
    """Prefill groups are priced by tokens in every mode: a cost model where every forward costs
    the same (which would put a 3- and a 40-token prompt in one padded forward) leaves `auto`'s
    prefill forwards those of AR (its cost model had priced them once: more, narrower forwards that
    took 1.03-1.08x AR's prefill time on a CPU)."""
    m, prompts = _model("int8"), _prompts([3, 40, 41, 5])
    shapes = {}
    for mode in ("ar", "auto"):
        cfg = DecodeConfig(mode=mode, max_new_tokens=2)
        dec = Decoder(m, prompts, cfg, eos_token_id=[], profile=CostModel.flat() if mode == "auto" else None)
        widths = Widths(dec)
        for _ in dec:
            pass
        shapes[mode] = widths.seen
    assert shapes["auto"] == shapes["ar"] and len(shapes["ar"]) == 2  # [3, 5] and [40, 41] apart


def test_a_prompt_cancelled_while_it_is_prefilled_frees_its_row():
    m = _model("int8")
    cfg = DecodeConfig(mode="ar", max_new_tokens=10)
    running, (long, other) = _prompts((5,)), _prompts((60, 7), seed=4)
    dec = Decoder(m, running, cfg, batch_size=3, eos_token_id=[], prefill_chunk=8)
    dec.step()
    a, b = dec.add(long), dec.add(other)
    dec.step()
    assert dec.scheduler.prefilling == [a, b] and dec.cancel(a) and not dec.cancel(a)
    for _ in dec:
        pass
    assert a.cancelled and dec.outputs[1] == [] and not dec.scheduler.busy
    assert dec.outputs[2] == generate_ids(m, other, cfg, eos_token_id=[])[0]
    assert dec.outputs[0] == generate_ids(m, running[0], cfg, eos_token_id=[])[0]


def test_the_chunk_is_the_largest_whose_forward_fits_the_rounds_given():
    """fixed + per_token x rows x width: a chunk of c tokens costs at most `rounds` AR rounds of R
    live rows while f + c p <= rounds (f + R p): with f = 30.2 ms, p = 1 ms, one live row and
    4 rounds, 94 tokens; a measured scale on the chunk's price and a measured AR round move it."""
    lin = CostModel.linear(per_token=1e-3, fixed=0.0302)
    assert pick_chunk(lin, 1, 10, 0, 10_000, rounds=4) == 94
    assert pick_chunk(lin, 2, 10, 0, 10_000, rounds=4) == 98
    assert pick_chunk(lin, 1, 10, 0, 50, rounds=4) == 50  # all that is left
    assert pick_chunk(lin, 1, 10, 0, 10_000, rounds=4, scale=2.0) == 32  # chunks took twice their price
    assert pick_chunk(lin, 1, 10, 0, 10_000, round_seconds=0.05) == 19  # a measured AR round of 50 ms
    assert pick_chunk(CostModel.linear(per_token=1e-3), 1, 10, 0, 10_000) == PREFILL_FLOOR  # steep: the floor
    # a short prompt (or a long one's last part) whose forward costs at most `whole` rounds: one chunk
    assert pick_chunk(lin, 1, 10, 0, 90) == 90 and pick_chunk(lin, 1, 10, 0, 95) == 1
    assert pick_chunk(CostModel.flat(), 3, 10, 0, 700) == 700  # a GPU's flat curve: the whole prompt


def _chunk_spans(dec, clock) -> list:
    """Wraps the decoder's own-forward chunk call: (start, end) on the fake clock of each, as they run."""
    own, spans = dec.scheduler.prefill.run_chunk, []

    def timed(*a):
        t0 = clock.t
        out = own(*a)
        spans.append((t0, clock.t))
        return out

    dec.scheduler.prefill.run_chunk = timed
    return spans


def _join_on_a_clock(learn: bool, fmt: str = "fp32", length: int = 150, per_token: float = 1e-3):
    """Two rows run (plan auto); a `length`-token prompt joins. The cost model says a forward costs
    10 ms plus `per_token` a token; the truth is three times that. Returns (seconds each chunk stalled
    the rows: its own forward in fp32, what it added to the round's in an exact format, where it
    rides there; seconds of an AR round of the two rows; (start, end) on the clock of every
    own-forward chunk; the decoder, its prompt prefilled)."""
    m = tiny_model(seed=2, vocab_size=V)
    if fmt != "fp32":
        set_weights(m, fmt)
    m.__dict__.pop("_selfspec_planners", None)
    cfg = DecodeConfig(max_new_tokens=60, block_length=4, budget=4)
    truth = CostModel.linear(per_token=3 * per_token, fixed=0.03)  # every forward 3x its price
    long_rows = [SamplingParams(max_new_tokens=200)] * 2  # running through the whole prefill (with none, the rest goes whole)
    dec = Decoder(m, _prompts((5, 6)), cfg, batch_size=3, eos_token_id=[], params=long_rows,
                  profile=CostModel.linear(per_token=per_token, fixed=0.01))
    clock = FakeClock()
    dec.stepper.clock = clock
    dec.bf = dec.stepper.bf = priced = PricedForward(dec.stepper.bf, clock, truth)
    for _ in range(3):
        dec.step()
    dec.add(_prompts((length,), seed=5)[0])
    priced.prefills, spans = [], _chunk_spans(dec, clock)
    while dec.scheduler.prefilling or dec.scheduler.waiting:
        if not learn:
            dec.scheduler.prefill.last_chunk = None  # a decoder that never learns what its chunks took
        dec.step()
    return priced.prefills, truth(2, 1, 10), spans, dec


def test_a_long_prompt_whose_chunks_ride_costs_each_running_row_at_most_one_more_round_a_turn():
    """The cost model underprices a chunk 3x (its cache axis, a busy machine): after the first
    chunk the decoder prices chunks by what they took, so each later one costs at most one AR
    round of the running rows (their gap between tokens at most about doubles) until the rest
    costs at most PREFILL_WHOLE_ROUNDS and goes in one; a decoder that trusts the cost model alone
    runs chunks of nearly two rounds or more every turn. In int8 the chunks ride in the rounds'
    forwards, and what a chunk took is what the forward took beyond the round's prediction."""
    chunks, ar, _, _ = _join_on_a_clock(learn=True, fmt="int8")
    assert len(chunks) > 5 and all(0.75 * ar <= c <= ar * 1.0001 for c in chunks[1:-1]), (chunks, ar)  # and no less
    assert chunks[-1] <= PREFILL_WHOLE_ROUNDS * ar * 1.0001  # the rest in one, once it is that short
    blind, _, _, _ = _join_on_a_clock(learn=False, fmt="int8")
    assert all(c > 1.5 * ar for c in blind[:-1]), (blind, ar)


def test_a_chunk_in_a_forward_of_its_own_is_worth_its_weight_pass_and_comes_spaced():
    """In fp32 a chunk runs in a forward of its own, a whole pass over the weights: after the first
    (priced 3x too cheap), each costs up to PREFILL_OWN_ROUNDS AR rounds of the running rows and
    no less than half that but the last, and the rows run (1 - PREFILL_SHARE) / PREFILL_SHARE
    times a chunk's time before the next: the rows keep 2/3 of the machine and most of their gaps
    are one round. A decoder that trusts the cost model alone runs chunks of 1.5x that or more."""
    chunks, ar, spans, _ = _join_on_a_clock(learn=True, length=180, per_token=3e-2)
    own = PREFILL_OWN_ROUNDS * ar
    assert len(chunks) > 4 and all(0.5 * own <= c <= own * 1.0001 for c in chunks[1:-1]), (chunks, ar)
    wait = (1 - PREFILL_SHARE) / PREFILL_SHARE
    assert all(b0 - a1 >= wait * (a1 - a0) - 1e-9 for (a0, a1), (b0, _) in zip(spans, spans[1:])), spans
    blind, _, _, _ = _join_on_a_clock(learn=False, length=180, per_token=3e-2)
    assert all(c > 1.5 * own for c in blind[:-1]), (blind, ar)


@pytest.mark.parametrize("fmt", EXACT)
def test_a_prompt_joining_in_auto_sized_chunks_gives_ar_output_in_every_format(fmt):
    """Plan auto sizes the chunks (riding in int8 / int4 / bf16, spaced forwards of their own in
    w4a8, whose rounds run in one C call): the joining prompt and the running rows still decode
    exactly what AR gives each alone."""
    _, _, spans, dec = _join_on_a_clock(learn=True, fmt=fmt, length=180, per_token=3e-2)
    assert (len(spans) > 1) == (not dec.bf.joins), (fmt, spans)  # own forwards only where chunks cannot ride
    for _ in dec:
        pass
    m, prompts = dec.model, dec.prompts
    for i, p in enumerate(prompts):
        want = generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=len(dec.outputs[i])), eos_token_id=[])[0]
        assert dec.outputs[i] == want, (fmt, i)


def test_a_seeded_sample_joining_in_chunks_equals_its_run_alone():
    """Reproducible sampling draws by output position: a sampled prompt prefilled in chunks while
    rows run gives the tokens its seed gives alone."""
    m = _model("int4")
    cfg = DecodeConfig(max_new_tokens=14, mode="presto", schedule="one-pass", block_length=4, budget=6)
    hot = SamplingParams(max_new_tokens=14, temperature=3.0)
    running, (long,) = _prompts((7, 4)), _prompts((45,), seed=6)
    dec = Decoder(m, running, cfg, batch_size=3, eos_token_id=[], prefill_chunk=8)
    dec.step()
    seq = dec.add(long, params=hot, seed=11)
    for _ in dec:
        pass
    assert seq.stats.prefill_forwards >= 6
    alone = Decoder(m, [long], cfg, eos_token_id=[], params=[hot], seeds=[11])
    for _ in alone:
        pass
    assert dec.outputs[2] == alone.outputs[0]
    assert dec.outputs[2] != generate_ids(m, long, cfg, eos_token_id=[])[0]  # a sample, not the greedy answer


def test_a_long_prompt_joining_a_stream_through_the_server_is_chunked_and_exact():
    """Through the HTTP server (lookup mode: 256-token chunks): while one answer streams, a
    ~700-token prompt joins; the stream keeps delivering before the long prompt's first token,
    which comes after three chunk forwards, and both answers equal `selfspec.generate`'s (int8:
    width-invariant, so the chunked K/V is the one-forward prefill's)."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    import time

    import selfspec
    from test_server import LONG, MODEL, LiveServer, int8_code_prompt, stream_in_thread, wait_for

    model, tok, long = int8_code_prompt(700)
    srv = LiveServer(model, tok, max_batch=2, max_queue=2)
    try:
        log = []
        running = stream_in_thread(srv.client(), LONG, 400, log)
        wait_for(lambda: log, "the running request's first token")
        sent, first, got, stats = time.perf_counter(), None, "", {}
        for chunk in srv.client().completions.create(model=MODEL, prompt=long, max_tokens=8, temperature=0,
                                                     stream=True):
            first = first or time.perf_counter()
            got += chunk.choices[0].text if chunk.choices else ""
            stats = getattr(chunk, "selfspec", None) or stats
        running.join(60)
    finally:
        srv.close()
    assert sum(bool(sent < t < first and piece) for t, piece, _ in log) > 0  # the stream ran on meanwhile
    assert stats["prefill_forwards"] >= 3
    assert got == selfspec.generate(model, tok, long, max_new_tokens=8, mode="lookup").text
    assert "".join(piece for _, piece, _ in log) == selfspec.generate(model, tok, LONG, max_new_tokens=400,
                                                                      mode="lookup").text


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_prompts_entering_with_nothing_running_are_prefilled_in_pieces_with_the_same_kv(fmt):
    """Past `Prefill.piece` tokens the prompts entering together run in forwards of that many
    columns (the exact attention's scores grow with the square of a forward's width); the K/V,
    the first tokens and the output are the one-forward prefill's, bit for bit."""
    m = _model(fmt)
    prompts = _prompts((37, 35, 36), seed=5)  # alike in length: one forward (rows shortest first)
    runs = {}
    for piece in (8, 1000):
        dec = Decoder(m, prompts, DecodeConfig(mode="ar", max_new_tokens=6), eos_token_id=[])
        dec.start()
        dec.scheduler.prefill.piece = piece
        widths = Widths(dec)
        dec.step()  # the prefill turn: every prompt enters, nothing runs
        cache = dec.stepper.cache
        kv = [[(k[r, :, :n].clone(), v[r, :, :n].clone()) for k, v in zip(cache.k, cache.v)]
              for r, n in enumerate(len(q.prompt) for q in dec.scheduler.live)]
        for _ in dec:
            pass
        runs[piece] = (kv, list(dec.outputs), widths.seen)
    (kv8, out8, seen8), (kv_all, out_all, seen_all) = runs[8], runs[1000]
    assert seen8 == [(3, 8)] * 4 + [(3, 5)] and seen_all == [(3, 37)]  # 37 tokens: pieces of 8, 8, 8, 8, 5
    assert out8 == out_all == [generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=6), eos_token_id=[])[0]
                               for p in prompts]
    assert all(torch.equal(a, b) for row8, row in zip(kv8, kv_all) for (k8, v8), (k, v) in zip(row8, row)
               for a, b in ((k8, k), (v8, v)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_prompt_prefilled_in_pieces_gives_ar_output_in_every_mode_and_format(fmt):
    """Pieces of 8 columns for a 37-token prompt: every layout's greedy output equals AR's in the
    format (fp32 too, where the pieces' K/V need not be the one forward's bits: AR reads the same)."""
    m = set_weights(tiny_model(seed=2, vocab_size=V), fmt) if fmt == "fp32" else _model(fmt)
    prompt = _prompts((37,), seed=6)[0]
    outs = {}
    for name, cfg in (("ar", DecodeConfig(mode="ar", max_new_tokens=12)),
                      ("lookup", DecodeConfig(mode="lookup", max_new_tokens=12)),
                      ("presto", DecodeConfig(mode="presto", schedule="one-pass", budget=6, block_length=4,
                                              max_new_tokens=12)),
                      ("linear", DecodeConfig(mode="linear", schedule="two-pass", block_length=4, max_new_tokens=12))):
        dec = Decoder(m, [prompt], cfg, eos_token_id=[])
        dec.start()
        dec.scheduler.prefill.piece = 8
        for _ in dec:
            pass
        assert dec.stats[0].prefill_forwards >= 5, name
        outs[name] = dec.outputs[0]
    assert all(o == outs["ar"] for o in outs.values()), outs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("mode", [dict(mode="ar"), dict(mode="lookup"),
                                  dict(mode="presto", schedule="one-pass", block_length=4, budget=6),
                                  dict(block_length=4, budget=6)])  # plan auto
def test_in_the_exact_formats_a_joining_prompts_chunks_ride_in_the_rounds_forwards(fmt, mode):
    """Where every row's bits are the same in any batch (the exact formats), the 70-token
    prompt's nine chunks run inside the live rows' round forwards (no forward of their own: no
    second pass over the weights a turn); fp32 runs them as forwards of their own, and so does
    w4a8 where its rounds run all layers in one C call (a riding chunk would cost them that). In
    every format and layout every row's greedy output equals AR's."""
    m = set_weights(tiny_model(seed=2, vocab_size=V), fmt) if fmt == "fp32" else _model(fmt)
    m.__dict__.pop("_selfspec_planners", None)
    cfg = DecodeConfig(max_new_tokens=20, **mode)
    running, (long,) = _prompts((5, 9)), _prompts((70,), seed=1)
    dec = Decoder(m, running, cfg, batch_size=3, eos_token_id=[], prefill_chunk=8)
    dec.step()
    dec.add(long)
    w = Widths(dec)
    for _ in dec:
        pass
    assert w.seen == [(1, 8)] * 8 + [(1, 6)]
    if fmt == "fp32" or FastForward.of(m).one_call():
        assert w.joined == 0
    elif cfg.mode == "ar":
        assert w.joined == 9
    else:  # speculating rows may finish before the prompt is in: its last chunks then go alone
        assert 0 < w.joined <= 9
    ar = DecodeConfig(mode="ar", max_new_tokens=20)
    assert list(dec.outputs) == [generate_ids(m, p, ar, eos_token_id=[])[0] for p in running + [long]]


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=["auto", "presto-one-pass"])
def test_prompts_that_start_alike_prefill_their_common_prefix_once_with_the_same_kv(fmt, layout):
    """Three prompts entering together share their first 20 tokens (a system prompt): the prefix
    runs once, in one row, and is copied into the others, which run only their own tails; every
    row's K/V is its lone prefill's bit for bit and every output equals AR's. A burst joining a
    running row whose prompt holds that prefix copies it from that row: no prefix forward at all."""
    m = _model(fmt)
    cfg = DecodeConfig(max_new_tokens=6, **layout)
    ar = DecodeConfig(mode="ar", max_new_tokens=6)
    head = _prompts((20,), seed=7)[0]
    prompts = [head + t for t in _prompts((5, 9, 7), seed=8)]
    dec = Decoder(m, prompts, cfg, eos_token_id=[])
    w = Widths(dec)
    dec.step()
    assert (1, 20) in w.seen, w.seen  # the prefix, in one row
    assert sum(r * c for r, c in w.seen) < sum(map(len, prompts))  # the prefix did not run three times
    live = dec.scheduler.live
    for r, q in enumerate(live):
        n = len(q.prompt)
        assert _same_kv([(k[r, :, :n], v[r, :, :n]) for k, v in zip(dec.cache.k, dec.cache.v)], _alone_kv(m, q.prompt))
    for _ in dec:
        pass
    assert list(dec.outputs) == [generate_ids(m, p, ar, eos_token_id=[])[0] for p in prompts]

    dec = Decoder(m, [prompts[0]], cfg, batch_size=4, eos_token_id=[])  # one runs, three more arrive at once
    dec.step()
    joining = [head + t for t in _prompts((4, 6, 3), seed=9)]
    seqs = [dec.add(p) for p in joining]
    w = Widths(dec)
    dec.step()
    assert all(c < 20 for _, c in w.seen), w.seen  # tails only: the prefix came from the running row
    for s in seqs:
        r, n = dec.scheduler.live.index(s), len(s.prompt)
        assert _same_kv([(k[r, :, :n], v[r, :, :n]) for k, v in zip(dec.cache.k, dec.cache.v)], _alone_kv(m, s.prompt))
    for _ in dec:
        pass
    assert [dec.outputs[s.index] for s in seqs] == [generate_ids(m, p, ar, eos_token_id=[])[0] for p in joining]


@pytest.mark.parametrize("fmt", EXACT)
@pytest.mark.parametrize("layout", [dict(mode="ar"), dict(block_length=4, budget=6)], ids=["ar", "auto"])
def test_a_prompt_joining_running_rows_alone_copies_the_prefix_it_shares_with_one_of_them(fmt, layout):
    """A prompt added while rows run is no burst: it is prefilled in chunks (riding in the rounds'
    forwards, or in forwards of their own). Two prompts are added in consecutive turns, each
    starting with a running row's first 20 tokens (a chat template): each copies their K/V from
    that row, and the very next turn's chunk runs only its own tail (the second one too, though
    the first one's chunk just ran: a copied prefix is no chunk that spaces the next); their K/V
    is their lone prefill's bit for bit and every output equals AR's."""
    m = _model(fmt)
    m.__dict__.pop("_selfspec_planners", None)
    head = _prompts((20,), seed=7)[0]
    running = [head + _prompts((5,), seed=8)[0], _prompts((9,), seed=8)[0]]
    joining = [head + t for t in _prompts((6, 4), seed=9)]
    dec = Decoder(m, running, DecodeConfig(max_new_tokens=12, **layout), batch_size=4, eos_token_id=[])
    dec.step()
    w = Widths(dec)
    for p in joining:
        seq = dec.add(p)
        w.seen.clear()
        dec.step()
        assert w.seen == [(1, len(p) - 20)], w.seen  # the tail only, at once
        r, n = dec.scheduler.live.index(seq), len(p)
        assert _same_kv([(k[r, :, :n], v[r, :, :n]) for k, v in zip(dec.cache.k, dec.cache.v)], _alone_kv(m, p))
    for _ in dec:
        pass
    ar = DecodeConfig(mode="ar", max_new_tokens=12)
    assert list(dec.outputs) == [generate_ids(m, p, ar, eos_token_id=[])[0] for p in running + joining]


def test_prompts_that_start_alike_run_whole_where_a_row_is_not_exact():
    """fp32 rows are not bitwise width-invariant: a copied prefix would not be what the row writes
    itself, so nothing is shared there."""
    m = tiny_model(seed=2, vocab_size=V)
    head = _prompts((20,), seed=7)[0]
    prompts = [head + t for t in _prompts((5, 9), seed=8)]
    dec = Decoder(m, prompts, DecodeConfig(mode="ar", max_new_tokens=3), eos_token_id=[])
    w = Widths(dec)
    dec.step()
    assert sum(r * c for r, c in w.seen) >= sum(map(len, prompts))


def test_shared_prefixes_plan_copies_from_a_donor_or_from_the_first_row_of_a_group():
    """The docstring's example; a donor holding less than SHARED_MIN of the prefix is not used; each
    row keeps its last token to run; rows that hold part of their prompt (None) take no part."""
    A, B = list(range(100, 120)), list(range(200, 230))
    prompts = [A + [1], A + [2, 3], B]
    assert shared_prefixes(prompts, []) == [(False, 0, 20, [1])]
    assert shared_prefixes(prompts, [(7, A + [9])]) == [(True, 7, 20, [0, 1])]
    assert shared_prefixes(prompts, [(7, A[:10])]) == [(False, 0, 20, [1])]
    assert shared_prefixes([A, A], []) == [(False, 0, 19, [1])]
    assert shared_prefixes([A + [1], None, A + [2]], []) == [(False, 0, 20, [2])]
    assert shared_prefixes([B, A + [1]], []) == []


def _short_joins(m, adds: list[list[int]]):
    """Plan auto, chunks in forwards of their own, two rows running on a fake clock where a
    forward costs 10 ms + 1 ms a token; at turn 3 + i the prompts `adds[i]` (lengths) are added.
    Returns, per turn from the first add, the [rows, width] of the prompt chunks run in it."""
    cfg = DecodeConfig(max_new_tokens=40, block_length=4, budget=4)
    cost = CostModel.linear(per_token=1e-3, fixed=0.01)
    rows = sum(len(a) for a in adds) + 2
    dec = Decoder(m, _prompts((5, 6)), cfg, batch_size=rows, eos_token_id=[], profile=cost,
                  params=[SamplingParams(max_new_tokens=200)] * 2)
    clock = FakeClock()
    dec.stepper.clock = clock
    dec.bf = dec.stepper.bf = PricedForward(dec.stepper.bf, clock, cost)
    for _ in range(3):
        dec.step()
    seen, turns = [], []
    Widths(dec).seen = seen
    for i in range(len(adds) + 3):
        for n in adds[i] if i < len(adds) else []:
            dec.add(_prompts((n,), seed=10 + i + n)[0])
        seen.clear()
        dec.step()
        turns.append(list(seen))
    return turns, dec


@pytest.mark.parametrize("fmt", ["fp32", "w4a8"])  # the formats whose chunks run in forwards of their own
def test_short_prompts_joining_in_forwards_of_their_own_are_prefilled_at_once_not_spaced(fmt):
    """Spacing (`chunk_due`) is for a long prompt's pieces: a short prompt added right after another
    one's chunk is prefilled in the very next turn (a free row that waits decodes nothing, and the
    chunk costs the same whenever it runs), and prompts that wait together go in one forward
    (its price allows 12 AR rounds), as a fixed mode's joins do."""
    m = tiny_model(seed=2, vocab_size=V)
    if fmt != "fp32":
        set_weights(m, fmt)
    m.__dict__.pop("_selfspec_planners", None)
    turns, dec = _short_joins(m, [[7], [8], [6, 9]])
    assert not dec.bf.joins
    assert turns[:3] == [[(1, 7)], [(1, 8)], [(2, 9)]], turns
    assert len(dec.scheduler.live) == 6 and not dec.scheduler.prefilling


@pytest.mark.parametrize("fmt", FORMATS)  # chunks that could ride (int8, int4, bf16) and ones that cannot
@pytest.mark.parametrize("layout", [dict(mode="ar"), dict(mode="lookup"),
                                    dict(mode="presto", schedule="one-pass", block_length=4, budget=6)],
                         ids=["ar", "lookup", "presto"])
def test_in_a_fixed_mode_a_long_prompts_pieces_come_in_forwards_of_their_own_spaced_like_autos(fmt, layout,
                                                                                              monkeypatch):
    """A fixed layout (no planner, no chunk given; the fixed piece made 32 tokens for the tiny model's 256
    positions): a 150-token prompt joins two running rows on a fake clock (10 ms + 1 ms a token a
    forward). Its pieces run in forwards of their own (in int8 too, where a chunk could ride: a
    fixed piece in every round would make each of the rows' rounds that much wider), and the rows
    run (1 - PREFILL_SHARE) / PREFILL_SHARE times a piece's time before the next (a 256-token piece
    every turn had held 4 rows to a token per ~0.3 s while a 2,000-token prompt joined, w4a8); every
    output equals AR."""
    monkeypatch.setattr("selfspec.engine.schedule.prefill.PREFILL_CHUNK", 32)
    m = tiny_model(seed=2, vocab_size=V) if fmt == "fp32" else _model(fmt)
    m.__dict__.pop("_selfspec_planners", None)
    cfg = DecodeConfig(max_new_tokens=60, **layout)
    running, (long,) = _prompts((5, 6)), _prompts((150,), seed=7)
    long_rows = [SamplingParams(max_new_tokens=200)] * 2  # running through the whole prefill
    dec = Decoder(m, running, cfg, batch_size=3, eos_token_id=[], params=long_rows)
    clock = FakeClock()
    dec.stepper.clock = clock
    dec.bf = dec.stepper.bf = PricedForward(dec.stepper.bf, clock, CostModel.linear(per_token=1e-3, fixed=0.01))
    for _ in range(3):
        dec.step()
    seq = dec.add(long)
    widths, spans = Widths(dec), _chunk_spans(dec, clock)
    while not seq.emitted:
        dec.step()
    assert widths.joined == 0 and widths.seen == [(1, 32)] * 4 + [(1, 22)]
    wait = (1 - PREFILL_SHARE) / PREFILL_SHARE
    assert all(b0 - a1 >= wait * (a1 - a0) - 1e-9 for (a0, a1), (b0, _) in zip(spans, spans[1:])), spans
    while dec.busy:
        dec.step()
    ar = [DecodeConfig(mode="ar", max_new_tokens=n) for n in (200, 200, 60)]
    assert list(dec.outputs) == [generate_ids(m, p, c, eos_token_id=[])[0] for p, c in zip(running + [long], ar)]


def test_whole_prompts_counts_the_waiting_prompts_one_forward_prefills_padded_to_its_longest():
    ms = lambda c: c * 1e-3  # noqa: E731
    assert whole_prompts([30, 40, 200], ms, 0.1) == 2  # 2 x 40 tokens; 3 x 200 do not fit
    assert whole_prompts([40, 30, 30], ms, 0.1) == 2  # 3 x 40 = 120 > 100
    assert whole_prompts([150], ms, 0.1) == 0
