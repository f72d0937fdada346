"""The exact formats' layer steps in C (`kernels/layer.c`: RMSNorm, the residual with the next
norm, RoPE onto the attention grids, the MLP's gate, the draft LoRA's delta) and one layer's attention in one call
(`attn16.direct`): each gives its torch twin's bits, on one row and on many, and a row's result
does not depend on the rows beside it. Whole forwards over them stay width-invariant and equal
to AR (test_invariance, test_format_matrix)."""

import math

import pytest
import torch

from selfspec.engine.forward.attention import write_attend
from selfspec.kernels import attn16, build
from selfspec.kernels import layer as kl

needs_kernel = pytest.mark.skipif(not kl.available() or attn16._fn("attn16_direct") is None,
                                  reason=f"no C kernel here: {build.error('layer') or build.error('attn16')}")
ROWS = [1, 3, 40, 700]  # 700 x 576 runs on several threads


def _h(m, k=576, seed=0, scale=5.0):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * scale
    x[0, :7] = 1e-20  # tiny values: their squares are far below the others'
    return x


@needs_kernel
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_and_the_residual_step_give_the_twins_bits(m, out_dtype):
    h, w = _h(m), torch.rand(576, generator=torch.Generator().manual_seed(1)) + 0.5
    assert torch.equal(kl.rms(h, w, 1e-5, out_dtype=out_dtype), kl.rms(h, w, 1e-5, out_dtype=out_dtype, fallback=True))
    o = _h(m, seed=2, scale=3.0).to(torch.bfloat16)
    h1, h2 = h.clone(), h.clone()
    y1 = kl.add_rms(h1, o, w, 1e-5, out_dtype=out_dtype)
    y2 = kl.add_rms(h2, o, w, 1e-5, out_dtype=out_dtype, fallback=True)
    assert torch.equal(y1, y2) and torch.equal(h1, h2) and torch.equal(h1, h + o.float())
    # and it is RMSNorm
    ref = torch.nn.functional.rms_norm(h1, (576,), w, 1e-5)
    assert torch.allclose(y1.float(), ref, rtol=1e-2 if out_dtype == torch.bfloat16 else 1e-5, atol=1e-6)


@needs_kernel
def test_a_rows_norm_is_the_same_alone_and_among_many():
    h, w = _h(700), torch.rand(576) + 0.5
    assert torch.equal(kl.rms(h, w, 1e-5)[5:6], kl.rms(h[5:6].clone(), w, 1e-5))


@needs_kernel
@pytest.mark.parametrize("m", ROWS)
def test_rope_onto_the_grids_gives_the_twins_bits(m):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(m, 15 * 64, generator=g) * 4).to(torch.bfloat16)
    pos = torch.randint(0, 300, (m,), generator=g)
    tabs = [torch.randn(400, 64, generator=g, dtype=torch.float64) * 1000 for _ in range(4)]
    y = kl.rope(x, pos, tabs, 9, 3, 256.0)
    assert torch.equal(y, kl.rope(x, pos, tabs, 9, 3, 256.0, fallback=True))
    assert torch.equal(y[:, 12:], torch.round(x.double().view(m, 15, 64)[:, 12:] * 256.0))  # value heads: scaled
    assert torch.equal(y, torch.round(y))


@needs_kernel
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("f", [1536, 13])  # 13: the vector loop's tail
def test_the_mlp_gate_gives_the_twins_bits_and_is_silu(m, f):
    gu = (torch.randn(m, 2 * f, generator=torch.Generator().manual_seed(4)) * 6).to(torch.bfloat16)
    gu[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])  # past the exponential's clamp, and signed zeros
    g, u = gu[:, :f], gu[:, f:]  # strided rows, as the fused gate/up output's halves
    y = kl.silu_mul(g, u)
    assert torch.equal(y, kl.silu_mul(g, u, fallback=True))
    ref = torch.nn.functional.silu(g.float()) * u.float()
    assert torch.allclose(y.float(), ref, rtol=2e-2, atol=1e-30)


@needs_kernel
@pytest.mark.parametrize("w", [1, 5])
def test_attention_output_in_bf16_heads_side_by_side_is_the_twins(w):
    g = torch.Generator().manual_seed(5)
    pv = torch.randn(2, 3, 3 * w, 64, generator=g, dtype=torch.float64) * 1e6
    den = torch.rand(2, 3, 3 * w, 1, generator=g, dtype=torch.float64) * 1e5 + 1
    assert torch.equal(attn16.out(pv, den, w), attn16.out(pv, den, w, fallback=True))


def _layer_inputs(R, S, seed=6, first=0, bits=16, dtype=torch.int16):
    """x [R, 1, 9 + 2 x 3, 64] grid integers, a compact cache (int16, or int8: the one-byte cache)
    whose rows first .. first + R - 1 hold S - 1 tokens (the rows before them others); values of
    about 2^bits (bits 12: every V shift 0 in int16, at most 8 in int8)."""
    from selfspec.engine.forward.cache import BatchKVCache

    g = torch.Generator().manual_seed(seed)
    cache = BatchKVCache([torch.device("cpu")], 3, 64, first + R, S + 8, dtype)
    old = torch.round(torch.randn(first + R, 3, S - 1, 64, generator=g, dtype=torch.float64) * 2.0 ** bits)
    cache.write(0, slice(0, first + R), [0] * (first + R), old, old * 0.5)
    x = torch.round(torch.randn(R, 1, 15, 64, generator=g, dtype=torch.float64) * 2.0 ** bits)
    return cache, x


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.int16, torch.int8])
@pytest.mark.parametrize("R,masked,first", [(1, False, 0), (1, True, 0), (3, True, 0), (2, True, 2)])
def test_one_call_attention_writes_and_attends_as_the_steps_do(R, masked, first, dtype):
    """attn16.direct (store K and V, scores, weights, weighted sums, bf16 output in one C call)
    against the same steps one by one (`BatchKVCache.write` and `exact_attention`)."""
    from selfspec.engine.forward.attention import exact_attention, grid_for

    S = 50
    starts = [S - 1 - r for r in range(R)]  # rows of different lengths
    grid = grid_for(64, 2.0 ** 4, 2.0 ** 4, 2.0 ** 3, 4096)
    mask = None
    if masked:
        mask = torch.zeros(R, 1, 1, S, dtype=torch.float64)
        for r, st in enumerate(starts):
            mask[r, ..., st + 1:] = float("-inf")  # scratch slots past the row's new token
        mask[..., 7] = float("-inf")
        mask = mask[0, 0] if R == 1 else mask
    args = (grid.scale, grid.shift, 2.0 ** grid.v)
    c1, x = _layer_inputs(R, S, first=first, dtype=dtype)  # rows first.. (a prefill chunk's rows behind the live ones)
    c2, _ = _layer_inputs(R, S, first=first, dtype=dtype)
    rows = slice(first, first + R)
    a = write_attend(c1, 0, rows, starts, x, 9, mask, *args)
    assert a is not None and a.shape == (R, 1, 9 * 64)
    xs = x.transpose(1, 2)
    kc, vc = c2.write(0, rows, starts, xs[:, 9:12], xs[:, 12:])
    ref = exact_attention(xs[:, :9], kc, vc, mask, grid, torch.bfloat16, heads_last=True)
    assert torch.equal(a, ref)
    for buf1, buf2 in zip(c1._buffers(), c2._buffers()):
        assert torch.equal(buf1, buf2)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.int16, torch.int8])
@pytest.mark.parametrize("S,R,w,threads", [(512, 1, 1, 2), (1037, 1, 1, 2), (1037, 2, 1, 3), (700, 2, 3, 2)])
def test_a_long_contexts_keys_split_over_the_threads_give_the_steps_bits(S, R, w, threads, dtype):
    """From 512 keys a one-token round splits its keys over the threads (`attn16_split.h`): each
    thread's scores, weights and partial weighted sums, the maxima and sums met across threads; a
    wider round (w = 3) takes the chunked weighted sums. Against the steps one by one: rows of
    different lengths, masked keys, a key count no thread count divides, scores spread so that
    some weights have a high limb and most do not."""
    from selfspec.engine.forward.attention import exact_attention

    starts = [S - w - r for r in range(R)]
    g = torch.Generator().manual_seed(S + w)
    mask = torch.zeros(R, 1, w, S, dtype=torch.float64)
    mask[torch.rand(R, 1, 1, S, generator=g).expand(R, 1, w, S) < 0.1] = float("-inf")
    for r, st in enumerate(starts):
        for t in range(w):
            mask[r, 0, t, st + t + 1:] = float("-inf")
    mask = mask[0, 0] if R == 1 else mask
    args = (2.0 ** -26, 20 * math.log(2.0), 2.0 ** 10)  # scores of a few units: weights of every size
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        c1, x = _layer_inputs(R, S, bits=12, dtype=dtype)
        c2, _ = _layer_inputs(R, S, bits=12, dtype=dtype)
        x = torch.cat([x] * w, 1) + torch.arange(w, dtype=torch.float64).view(1, w, 1, 1)  # w different tokens
        a = write_attend(c1, 0, slice(0, R), starts, x.contiguous(), 9, mask, *args)
        xs = x.transpose(1, 2)
        kc, vc = c2.write(0, slice(0, R), starts, xs[:, 9:12], xs[:, 12:])
        grid = type("G", (), {"scale": args[0], "shift": args[1], "v": 10})
        ref = exact_attention(xs[:, :9], kc, vc, mask, grid, torch.bfloat16, heads_last=True)
    finally:
        torch.set_num_threads(old)
    assert a is not None and torch.equal(a, ref)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.int16, torch.int8])
@pytest.mark.parametrize("R,w,first", [(1, 1, 0), (3, 1, 0), (1, 3, 0), (2, 5, 2)])
def test_one_call_attentions_integer_weighted_sums_are_its_float64_ones(R, w, first, dtype):
    """Where V's shifts agree (values below 2^15), the one call's weighted sums run in int32 lanes
    on AVX-512 VNNI (`pv_words`, words written with the weights): the same bits as with that path
    off (`attn16_set_int_pv`), for one token, three (tiles of six queries and a last one of three),
    rows of different lengths and rows behind others; a machine without it runs the float64 tiles
    both times."""
    from selfspec.engine.forward.attention import grid_for

    S = 61  # an odd count of keys: the last pairs with a weight of 0
    starts = [S - w - r for r in range(R)]
    grid = grid_for(64, 2.0 ** 4, 2.0 ** 4, 2.0 ** 3, 4096)
    mask = torch.zeros(R, 1, w, S, dtype=torch.float64)
    for r, st in enumerate(starts):
        for t in range(w):
            mask[r, 0, t, st + t + 1:] = float("-inf")
    mask = mask[0, 0] if R == 1 else mask
    args = (grid.scale, grid.shift, 2.0 ** grid.v)
    toggle = attn16._fn("attn16_set_int_pv")
    outs = []
    for on in (1, 0):
        cache, x = _layer_inputs(R, S, first=first, bits=12, dtype=dtype)
        vmax = int(cache.shifts[1].max())  # the integer path's condition: V shifts all 0 (int16), at most 8 (int8)
        assert vmax == 0 if dtype == torch.int16 else 0 < vmax <= 8
        before = toggle(on)
        try:
            outs.append(write_attend(cache, 0, slice(first, first + R), starts, torch.cat([x] * w, 1), 9, mask, *args))
        finally:
            toggle(before)
    assert outs[0] is not None and torch.equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.int16, torch.int8])
@pytest.mark.parametrize("R,w,bits", [(1, 1, 12), (4, 1, 12), (1, 4, 12), (3, 2, 16)])
def test_one_call_attention_gives_the_same_bits_on_one_thread_and_shared_out(R, w, bits, dtype):
    """Each step of the one call (scores, weights, weighted sums) runs on one thread below
    `PAR_MIN` multiply-adds and shared out over the team above it (`attn16_set_par_min`): forced to
    each side, four rows of one token, one row of four, rows of different lengths, with and
    without the integer weighted sums (bits 16: V shifts that differ), the same bits."""
    from selfspec.engine.forward.attention import grid_for

    S = 81
    starts = [S - w - r for r in range(R)]
    mask = torch.zeros(R, 1, w, S, dtype=torch.float64)
    for r, st in enumerate(starts):
        for t in range(w):
            mask[r, 0, t, st + t + 1:] = float("-inf")
    mask = mask[0, 0] if R == 1 else mask
    grid = grid_for(64, 2.0 ** 4, 2.0 ** 4, 2.0 ** 3, 4096)
    args = (grid.scale, grid.shift, 2.0 ** grid.v)
    setp = attn16._fn("attn16_set_par_min")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    outs = []
    try:
        for par_min in (2 ** 62, 0):  # every step alone, then every step shared out
            before = setp(par_min)
            try:
                for seed in (par_min % 7 + 1, 6):  # other inputs first: no step passes on the last call's scratch
                    cache, x = _layer_inputs(R, S, seed=seed, bits=bits, dtype=dtype)
                    x = torch.cat([x] * w, 1) + torch.arange(w, dtype=torch.float64).view(1, w, 1, 1)
                    out = write_attend(cache, 0, slice(0, R), starts, x.contiguous(), 9, mask, *args)
                outs.append(out)
            finally:
                setp(before)
    finally:
        torch.set_num_threads(old)
    assert outs[0] is not None and torch.equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("past", ["queries", "scores"])
def test_one_call_attention_declines_wide_rounds_and_leaves_the_cache_alone(past, monkeypatch):
    w = attn16.direct_max() // 3 + 1 if past == "queries" else 4  # queries per row: 3 w per key head
    if past == "scores":
        monkeypatch.setattr(attn16, "DIRECT_SCORES", 3 * 3 * w * (20 + w) - 1)  # one score more than it keeps
    cache, x = _layer_inputs(1, 20 + w)
    wide = torch.cat([x] * w, 1)
    before = [b.clone() for b in cache._buffers()]
    assert write_attend(cache, 0, slice(0, 1), [20], wide, 9, None, 1.0, 1.0, 1.0) is None
    assert all(torch.equal(a, b) for a, b in zip(before, cache._buffers()))


@needs_kernel
def test_gumbel_candidates_hold_each_rows_winner_and_decline_flat_rows():
    """Every row's Gumbel-max winner is among its candidates (index order, at most 1/CANDIDATES_MAX
    of the vocabulary); a row whose distribution is too flat for that, or holds a NaN, declines (None)."""
    from selfspec.drafting.sampling import PositionNoise, gumbel

    g, V = torch.Generator().manual_seed(3), 49152
    taken = declined = 0
    for trial in range(120):
        n = (1, 3, 8)[trial % 3]
        x = torch.randn(n, V, generator=g) * (0.3, 3.0, 10.0, 30.0)[trial % 4]
        x[:, 7] = float("-inf")  # a banned token
        noise = PositionNoise(trial, V).rows([trial % 5 + i // 2 for i in range(n)])
        got = kl.gumbel_candidates(x, noise.u, noise.rows)
        if got is None:
            declined += 1
            continue
        taken += 1
        r, c = got.rows, got.tokens
        assert torch.equal(r * V + c, (r * V + c).sort().values) and len(r) <= n * (V // kl.CANDIDATES_MAX)
        winners = (x.double() + gumbel(noise.u[noise.rows])).argmax(-1)
        for i in range(n):
            assert int(winners[i]) in c[r == i].tolist(), (trial, i)
    assert taken > 30 and declined > 10  # both ways were taken
    x[0, 5] = float("nan")
    assert kl.gumbel_candidates(x, noise.u, noise.rows) is None


@needs_kernel
@pytest.mark.parametrize("case", ["spread", "tied maximum", "maximum last", "one finite token"])
def test_gumbel_candidates_are_the_tokens_whose_own_noise_may_reach_the_bound_of_the_rows_first_largest_logit(case):
    """The candidates are exactly the tokens k with x_k + g_k >= lb (g_k the token's own noise, with
    the kernel's margin), lb the noisy value of the row's first largest logit, among those that pass
    the coarser tests the kernel reads blocks by (x_k >= lb - the position's largest noise; the
    block's largest logit with the block's largest noise reaching lb): a scalar scan of the same rule
    gives the same pairs (the kernel's vector passes find the same first maximum and the same tokens)."""
    from selfspec.drafting.sampling import PositionNoise

    g, V = torch.Generator().manual_seed(11), 49153  # the shipped vocabulary: a last block of one token
    x = torch.randn(3, V, generator=g) * 8.0  # peaked enough that a row has ~150 tokens within the first bound
    if case == "tied maximum":
        x[:, 100] = x[:, 120] = x[:, 30000] = x.max() + 1.0  # the first of equal maxima sets the bound
    elif case == "maximum last":
        x[:, V - 1] = x.max() + 1.0
    elif case == "one finite token":
        x.fill_(float("-inf"))
        x[:, 4242] = 0.5
    noise = PositionNoise(3, V).rows([0, 1, 1])
    got = kl.gumbel_candidates(x, noise.u, noise.rows)
    assert got is not None and got.flat is None

    def gum(u: float) -> float:
        return -math.log(-math.log(u))

    def reaches(xv: float, gv: float, lb: float) -> bool:
        return lb == -math.inf if xv == -math.inf else xv + gv + 1e-9 * (1.0 + abs(xv) + abs(gv)) >= lb

    pairs = []
    for r in range(3):
        xs, us = x[r].double().tolist(), noise.u[noise.rows[r]].tolist()
        j = int(x[r].argmax())  # torch's argmax: the first of equal maxima
        lb = xs[j] + gum(us[j])
        lb -= 1e-9 * (1.0 + abs(lb))
        t = gum(max(us))  # the position's largest noise
        thr = lb - t - 1e-9 * (1.0 + abs(lb) + abs(t))
        for b0 in range(0, V, 64):
            block = range(b0, min(b0 + 64, V))
            top_x, top_u = max(xs[k] for k in block), max(us[k] for k in block)
            if top_x >= thr and reaches(top_x, gum(top_u), lb):
                pairs += [(r, k) for k in block if xs[k] >= thr and reaches(xs[k], gum(us[k]), lb)]
    assert 0 < len(pairs) < 3 * 40 or case == "one finite token"  # a few a row, not the first bound's ~150
    assert list(zip(got.rows.tolist(), got.tokens.tolist())) == pairs
    assert torch.equal(got.logits, x[got.rows, got.tokens].double())
    assert torch.equal(got.uniforms, noise.u[noise.rows[got.rows], got.tokens])


@needs_kernel
def test_a_positions_uniforms_in_c_are_the_torch_twins_bits_and_inside_the_unit_interval():
    from selfspec.drafting.sampling import mix, splitmix_uniforms

    for seed in (0, 1, 2**63 - 1, 2**63, 2**64 - 1, mix(5, 3, 1), 12345678901234567):
        c, t = kl.uniforms(seed, 49152), splitmix_uniforms(seed, 49152)
        assert torch.equal(c, t) and 0.0 < float(c.min()) and float(c.max()) < 1.0
    assert splitmix_uniforms(0, 1).item() == ((0xE220A8397B1DCDAF >> 11) + 0.5) / 2**53  # splitmix64's first output
    u = splitmix_uniforms(7, 1 << 18)
    counts = torch.histc(u.float(), bins=64, min=0.0, max=1.0)
    expected = u.numel() / 64
    assert float(((counts - expected) ** 2 / expected).sum()) < 110  # chi-square, 63 degrees of freedom, p ~ 0.0002
    pairs = torch.histc((u[:-1] * 8).floor() * 8 + (u[1:] * 8).floor(), bins=64, min=0, max=64)  # neighbours independent
    assert float(((pairs - (u.numel() - 1) / 64) ** 2 / ((u.numel() - 1) / 64)).sum()) < 110


@needs_kernel
def test_the_candidates_uniforms_made_from_seeds_are_their_positions_whole_rows():
    """Candidates from seeds (no row of uniforms stored): each pair's uniform is the number its
    position's whole row holds at its token (int64 seeds carry a uint64's bits), the positions'
    largest noise bounds them as the rows' do, and a flat row (every token a candidate) spans the
    vocabulary's edges."""
    from selfspec.drafting.sampling import _i64, mix, splitmix_uniforms

    seeds = [0, 2**63 - 1, 2**63, 2**64 - 1, mix(5, 3, 1)]
    V = 49153
    g = torch.Generator().manual_seed(2)
    x = torch.randn(len(seeds), V, generator=g) * 8.0
    x[1] = 0.0  # flat: every token a candidate...
    x[1, 100:] = float("-inf")  # ...of the first hundred, so the row keeps them
    x[2, [0, V - 1]] = x[2].max() + 1.0  # the vocabulary's first and last tokens
    s, rows = torch.tensor([_i64(v) for v in seeds]), torch.arange(len(seeds))
    got = kl.gumbel_candidates(x, None, rows, s)
    whole = torch.stack([splitmix_uniforms(seed, V) for seed in seeds])
    assert got is not None and {0, V - 1} <= set(got.tokens[got.rows == 2].tolist())
    assert torch.equal(got.uniforms, whole[got.rows, got.tokens])
    assert all(torch.equal(a, b) for a, b in zip(got[:4], kl.gumbel_candidates(x, whole, rows)[:4]))
    threads = torch.get_num_threads()
    try:  # the rows and positions shared out over threads or not: the same pairs
        torch.set_num_threads(1)
        alone = kl.gumbel_candidates(x, None, rows, s)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got[:4], alone[:4]))


@needs_kernel
def test_gumbel_candidates_from_seeds_are_those_from_the_whole_rows_and_a_flat_row_declines_alone():
    """Uniforms made where read (seeds) give the pairs the whole rows give; with flat=True a row
    too flat for candidates is flagged and has none, every other row keeps its own pairs."""
    from selfspec.drafting.sampling import PositionNoise

    g, V = torch.Generator().manual_seed(4), 4096
    x = torch.randn(4, V, generator=g) * 8.0
    noise = PositionNoise(9, V).rows([3, 4, 4, 5])
    x[2] = 0.0  # flat, its largest logit where its position's noise is least: nearly every token may win
    x[2, int(noise.u[noise.rows[2]].argmin())] = 0.01
    whole, seeded = (kl.gumbel_candidates(x[[0, 1, 3]], noise.u, noise.rows[[0, 1, 3]]),
                     kl.gumbel_candidates(x[[0, 1, 3]], None, noise.rows[[0, 1, 3]], noise.seeds))
    assert whole is not None and all(torch.equal(a, b) for a, b in zip(whole[:4], seeded[:4]))
    assert kl.gumbel_candidates(x, None, noise.rows, noise.seeds) is None  # one flat row: all decline
    r, c, _, _, flat = kl.gumbel_candidates(x, None, noise.rows, noise.seeds, flat=True)
    assert flat.tolist() == [False, False, True, False] and 2 not in r.tolist()
    keep = r != 2
    assert torch.equal(torch.where(r[keep] == 3, 2, r[keep]), whole.rows) and torch.equal(c[keep], whole.tokens)
