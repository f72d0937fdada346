"""The compact exact cache: K and V as int16 (or int8, the one-byte cache) with a power-of-two shift
per token and head. The C kernels (store, scores, weighted sums; read in place or decompressed for
wide rounds) give the bits of the torch fallback, a token's values round-trip within half its
step, and whole forwards stay width-invariant over it (test_invariance, test_format_matrix run on
this cache; test_invariance on the one-byte cache too)."""

import pytest
import torch

from selfspec.kernels import attn16, build

needs_kernel = pytest.mark.skipif(attn16._fn("attn16_scores") is None,
                                  reason=f"no C kernel here: {build.error('attn16')}")


def _grid_ints(*shape, bits=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.round(torch.randn(*shape, generator=g, dtype=torch.float64) * 2.0 ** bits)
    if shape[-2] > 2:
        x[..., 0, :] = 0.0  # an all-zero key: shift 0
        x[..., 1, :3] = 2.0 ** 15  # just past 15 bits: shift 1
    return x


def test_compress_keeps_small_values_exact_and_large_ones_within_half_a_step():
    x = _grid_ints(2, 3, 40, 64)
    m, s = attn16.compress(x)
    back = attn16.decompress(m, s)
    small = x.abs().amax(-1) < 2 ** 15
    assert torch.equal(back[small], x[small])  # fits 15 bits: no rounding at all
    step = torch.exp2(s.double())[..., None]
    assert bool(((back - x).abs() <= step / 2).all())
    assert int(m.abs().max()) <= 2 ** 15 - 1 and int(s.min()) >= 0


def test_the_docstring_example():
    m, s = attn16.compress(torch.tensor([[40000.0, -3.0, 1.0]], dtype=torch.float64))
    assert s.tolist() == [1] and m.tolist() == [[20000, -2, 0]]
    m, s = attn16.compress(torch.tensor([[300.0, -3.0, 1.0]], dtype=torch.float64), torch.int8)
    assert s.tolist() == [2] and m.tolist() == [[75, -1, 0]] and m.dtype == torch.int8
    m, c = attn16.compress_scaled(torch.tensor([[300.0, -3.0, 1.0]], dtype=torch.float64))
    assert c.tolist() == [3] and m.tolist() == [[100, -1, 0]] and c.dtype == torch.int32


def test_the_one_byte_caches_keys_round_within_half_their_scale_and_small_ones_stay_exact():
    x = _grid_ints(2, 3, 40, 64, bits=12)
    x[0, 0, 5] = torch.arange(64, dtype=torch.float64) - 32  # a key within +-127: scale 1, exact
    m, c = attn16.compress_scaled(x)
    back = attn16.decompress(m, c)
    assert int(c[0, 0, 5]) == 1 and torch.equal(back[0, 0, 5], x[0, 0, 5])
    assert bool(((back - x).abs() <= c.double()[..., None] / 2).all())  # 127 c >= max |x|: never clamped
    assert int(m.abs().max()) <= 127 and int(c.max()) > 2 ** 5


def test_the_one_byte_cache_keeps_seven_bits_exact_and_rounds_the_rest_within_half_a_step():
    x = _grid_ints(2, 3, 40, 64, bits=9)
    x[0, 0, 5] = torch.arange(64, dtype=torch.float64) - 32  # a token that fits 7 bits
    m, s = attn16.compress(x, torch.int8)
    back = attn16.decompress(m, s)
    small = x.abs().amax(-1) < 2 ** 7
    assert bool(small[0, 0, 5]) and torch.equal(back[small], x[small])  # stored exactly
    step = torch.exp2(s.double())[..., None]
    clamped = x.abs() >= 127.5 * step  # rounds to 128: kept at 127, within one step
    assert bool(((back - x).abs() <= step / 2)[~clamped].all()) and bool(((back - x).abs() <= step)[clamped].all())
    assert int(m.abs().max()) <= 127 and int(s.max()) >= 3 and bool(clamped.any())


@needs_kernel
@pytest.mark.parametrize("dt, side", [(torch.int16, torch.int8), (torch.int8, torch.int8), (torch.int8, torch.int32)])
@pytest.mark.parametrize("R,q", [(1, 1), (1, 7), (3, 4)])
def test_the_c_store_writes_the_fallbacks_bits_at_each_rows_own_slots(R, q, dt, side):
    """int16 with shifts; the one-byte cache's V (int8 with shifts) and K (int8 with integer scales)."""
    x = _grid_ints(R, q, 3, 64, seed=R + q).transpose(1, 2)  # the forward's strided K / V
    starts = [2 + 3 * r for r in range(R)]
    bufs = [torch.zeros(R, 3, 32, 64, dtype=dt), torch.zeros(R, 3, 32, dtype=side)]
    ref = [b.clone() for b in bufs]
    attn16.store(x, starts, *bufs)
    attn16.store(x, starts, *ref, fallback=True)
    assert torch.equal(bufs[0], ref[0]) and torch.equal(bufs[1], ref[1])
    assert int(bufs[0][:, :, :2].abs().sum()) == 0  # nothing before the starts


@needs_kernel
@pytest.mark.parametrize("dt, bits", [(torch.int16, 17), (torch.int8, 12), (torch.int8, 16)])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 5, 7, 9, 10, 13, 15, 48, attn16.DIRECT_MAX, attn16.DIRECT_MAX + 1, 375])
# every tile the weighted sums take (3, 6, 9, 12 queries, a last one of 1-3 beside full ones), in place and wide;
# the one-byte cache's values widened in registers (shifts up to 8: the integer lanes) or once (past 8)
def test_scores_and_weighted_sums_are_the_fallbacks_bits_in_place_and_wide(G, dt, bits):
    R, KV, S, D = 2, 3, 301, 64  # keys in blocks of 64, read four at a time: 301 leaves a tail of one
    x = _grid_ints(R, KV, S + 20, D, bits=bits)
    m, s = attn16.compress(x if bits > 12 else x.clamp(-(2 ** 15 - 1), 2 ** 15 - 1), dt)
    assert dt == torch.int16 or (int(s.max()) > 8) == (bits == 16)
    k, ks = m[:, :, :S], s[:, :, :S]  # views of a larger cache, as the runtime passes them
    if dt == torch.int8:  # the one-byte cache's K: integer scales
        mk, c = attn16.compress_scaled(x)
        k, ks = mk[:, :, :S], c[:, :, :S]
        assert int(c.max()) > 2 ** (bits - 7)
    q = _grid_ints(R, KV, G, D, bits=14, seed=1)
    assert torch.equal(attn16.scores(q, k, ks), attn16.scores(q, k, ks, fallback=True))
    k, ks = m[:, :, :S], s[:, :, :S]
    p = torch.round(torch.rand(R, KV, G, S, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 2 ** 20)
    p[..., ::5] = 0.0  # masked keys
    p[..., 0, 1::7] = 0.0  # keys one query gives no weight and the others do
    assert torch.equal(attn16.weighted(p, k, ks), attn16.weighted(p, k, ks, fallback=True))


@needs_kernel
@pytest.mark.parametrize("case", ["largest", "zeros", "one key", "past 2^20", "a fraction", "negative", "mixed shifts"])
@pytest.mark.parametrize("G", [1, 2, 3, 4, 7, 13])
def test_weighted_sums_in_integers_are_the_float64_sums_at_their_bounds(case, G):
    """AVX-512 VNNI: weight x value summed in int32 lanes, 30 key pairs at a time, in tiles of three
    or six queries: at the largest weights (2^20) and values (-32768) the lanes come within 7% of
    2^31, an odd key count pairs the last key with a weight of 0, and a weight past 2^20, a
    fraction, a negative one or V shifts that differ fall back to the float64 tiles. Every case
    gives the fallback's bits."""
    R, KV, S, D = 2, 3, 201, 64
    g = torch.Generator().manual_seed(4)
    p = torch.round(torch.rand(R, KV, G, S, generator=g, dtype=torch.float64) * 2 ** 20)
    v = torch.randint(-32767, 32768, (R, KV, S + 3, D), generator=g, dtype=torch.int16)[:, :, :S]
    shift = torch.zeros(R, KV, S + 3, dtype=torch.int8)[:, :, :S]
    if case == "largest":
        p.fill_(2.0 ** 20)
        v.fill_(-32768)
    elif case == "zeros":
        p[:, 1] = 0.0  # a key head no query weighs
        p[:, 0, :, 1::2] = 0.0
    elif case == "one key":
        p, v, shift = p[..., :1].contiguous(), v[:, :, :1], shift[:, :, :1]
    elif case == "past 2^20":
        p[..., -1] = 2.0 ** 20 + 1
    elif case == "a fraction":
        p[..., 7] = 0.5
    elif case == "negative":
        p[..., 3] = -2.0 ** 30  # an int32 whose high limb is no int16
    else:
        shift[1, :, ::3] = 2  # one row's
    assert torch.equal(attn16.weighted(p, v, shift), attn16.weighted(p, v, shift, fallback=True))


@needs_kernel
@pytest.mark.parametrize("dt", [torch.int16, torch.int8])
@pytest.mark.parametrize("pattern", ["small with a few large", "largest with gaps"])
@pytest.mark.parametrize("G", [1, 3, 4, 7])
def test_weighted_sums_over_a_long_context_are_the_float64_sums(pattern, G, dt):
    """A long context's keys split into chunks the threads sum apart, and the high limbs of a block
    of six key pairs are skipped where every query's weights there are below 2^10: the skipped
    products are zeros, so every sum is the fallback's. The largest weights and values with whole
    blocks at zero still flush each int32 lane before 30 pairs have filled it."""
    R, KV, S, D = 1, 3, 1203, 64  # 602 key pairs: three chunks of 240, the last short, and a last odd key
    g = torch.Generator().manual_seed(5)
    v = torch.randint(-32767, 32768, (R, KV, S, D), generator=g, dtype=torch.int16)
    shift = torch.zeros(R, KV, S, dtype=torch.int8)
    if pattern == "small with a few large":
        p = torch.round(torch.rand(R, KV, G, S, generator=g, dtype=torch.float64) * 1023)
        large = torch.rand(R, KV, G, S, generator=g) < 0.01  # one query's large weight in an otherwise small block
        p[large] = torch.round(torch.rand(int(large.sum()), generator=g, dtype=torch.float64) * 2 ** 20)
        p[..., 600:660] = 0.0  # a run no query weighs
    else:
        p = torch.full((R, KV, G, S), 2.0 ** 20, dtype=torch.float64)
        v.fill_(-32768)
        for start in range(0, S, 36):
            p[..., start:start + 12] = 0.0  # every third block of 12 keys: skipped between full ones
    if dt == torch.int8:  # the one-byte cache: the same values, 7 bits and a shift (1 .. 8) each
        v, shift = attn16.compress(v.double().clamp(-32767, 32767), dt)
        shift[..., ::5] = 8  # the largest a value widened in registers may take: +-127 x 2^8
        assert int(shift.max()) == 8
    assert torch.equal(attn16.weighted(p, v, shift), attn16.weighted(p, v, shift, fallback=True))


def test_the_fixed_exponential_rounds_like_exp_and_is_the_same_in_c_and_torch():
    """Within 0.5 + 2^-26 e^x of e^x (its float32 steps move it by less than 2^-28 e^x): the
    rounded e^x wherever that is 2^10 or less, at most one off it up to 2^20."""
    x = torch.cat([torch.linspace(-3, 20 * 0.6931471805599453, 200001, dtype=torch.float64),
                   torch.tensor([float("-inf"), -1.0, -1.0 - 1e-12, 0.0])])
    e = torch.where(x >= -1.0, torch.exp(x), torch.zeros_like(x))
    fast, slow = attn16.exp_round(x.clone()), attn16.exp_round(x.clone(), fallback=True)
    assert bool(((slow - e).abs() <= 0.5 + e * 2.0 ** -26).all())
    assert torch.equal(slow[e <= 1024], torch.round(e)[e <= 1024])
    assert torch.equal(slow, torch.round(slow)) and slow[x < -1.0].eq(0).all()
    if attn16._fn("attn16_exp_round") is not None:
        assert torch.equal(fast, slow)


@pytest.mark.parametrize("mask_kind", [None, "one row", "batch"])
def test_softmax_weights_are_the_fallbacks_bits_and_do_not_depend_on_where_a_score_sits(mask_kind):
    R, KV, w, S = 2, 3, 2, 61
    G = 3 * w
    s = torch.randn(R, KV, G, S, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2.0 ** 30
    mask = None
    if mask_kind == "one row":
        R, s = 1, s[:1].contiguous()
        mask = torch.zeros(w, S + 4, dtype=torch.float64)[:, :S]  # a view of a wider buffer, as MaskBuffer's
        mask[:, ::3] = float("-inf")
    elif mask_kind == "batch":
        mask = torch.zeros(R, 1, w, S, dtype=torch.float64)
        mask[..., 1::4] = float("-inf")
    args = (w, 2.0 ** -28, 20 * 0.6931471805599453, 1024.0)
    p, den = attn16.weights(s.clone(), mask, *args)
    p2, den2 = attn16.weights(s.clone(), mask, *args, fallback=True)
    assert torch.equal(p, p2) and torch.equal(den, den2)
    assert float(p.max()) == 2.0 ** 20 and torch.equal(den, p.sum(-1, keepdim=True) * 1024.0)
    # row (r, head 1, query 2: token 0) alone, at offset 0 of its own tensor: the same weights
    r = R - 1
    one_mask = None if mask is None else (mask[0:1] if mask.dim() == 2 else mask[r : r + 1, :, 0:1])
    alone, _ = attn16.weights(s[r : r + 1, 1:2, 2:3].clone(), one_mask, 1, *args[1:])
    assert torch.equal(alone[0, 0, 0], p[r, 1, 2])


def test_a_rounded_query_row_keeps_q_bits_and_its_scores_fit_int32():
    """round_q: the docstring example; every row a multiple of its own power of two with at most
    q_bits significant bits, so q' k summed over D dimensions of the int16 cache stays below 2^31."""
    row = torch.zeros(1, 64, dtype=torch.float64)
    row[0, :4] = torch.tensor([3000.0, 1001.0, 1003.0, -7.0])
    assert attn16.round_q(row)[0, :4].tolist() == [3000.0, 1000.0, 1004.0, -8.0]
    g = torch.Generator().manual_seed(3)
    for D in (64, 80, 128):
        q = torch.round(torch.randn(50, D, generator=g, dtype=torch.float64) * 2.0 ** torch.randint(0, 40, (50, 1), generator=g))
        r = attn16.round_q(q)
        _, e = torch.frexp(q.abs().amax(-1, keepdim=True))
        step = torch.pow(2.0, (e - attn16.q_bits(D)).clamp(min=0).double())
        ints = r / step
        assert torch.equal(ints, torch.round(ints)) and (r - q).abs().le(step / 2).all()
        assert ints.abs().max() * 32767 * D < 2 ** 31
        assert torch.equal(attn16.round_q(q[:7]), r[:7])  # a row's rounding is its own


@needs_kernel
@pytest.mark.parametrize("G", [1, 3, 7])
@pytest.mark.parametrize("top", [8, 9])
def test_one_byte_values_past_an_int16_lane_take_the_float64_sums(top, G):
    """A one-byte value widened times 2^shift fits an int16 lane up to shift 8 (127 x 2^8 < 2^15);
    one shift of 9 sends the weighted sums to the float64 tiles: the fallback's bits either way."""
    R, KV, S, D = 1, 3, 301, 64
    g = torch.Generator().manual_seed(7)
    p = torch.round(torch.rand(R, KV, G, S, generator=g, dtype=torch.float64) * 2 ** 20)
    v = torch.full((R, KV, S, D), -127, dtype=torch.int8)
    v[:, :, ::2] = 127
    shift = torch.full((R, KV, S), 8, dtype=torch.int8)
    shift[0, 1, 17] = top
    assert torch.equal(attn16.weighted(p, v, shift), attn16.weighted(p, v, shift, fallback=True))


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@needs_kernel
@pytest.mark.parametrize("march, needs", [("x86-64", set()), ("haswell", {"avx2", "fma", "f16c"})],
                         ids=["scalar", "avx2"])
def test_the_scalar_and_avx2_builds_give_the_fallbacks_bits_for_both_caches(kernel_build, monkeypatch, march, needs):
    """What CPUs without AVX-512 run (this one takes the AVX-512 paths): the kernels built for them,
    over the int16 and the one-byte cache (its values widened as they are loaded), against the
    torch fallback."""
    import ctypes
    import os

    if os.uname().machine not in ("x86_64", "AMD64") or not needs <= _cpu_flags():
        pytest.skip("an x86 CPU with these instructions")
    lib, real = ctypes.CDLL(kernel_build("attn16", march)), attn16._fn

    def fn(name):
        f, ours = getattr(lib, name), real(name)
        f.argtypes, f.restype = ours.argtypes, ours.restype
        return f

    monkeypatch.setattr(attn16, "_fn", fn)
    monkeypatch.setattr(attn16, "_PV_WIDE", None)
    R, KV, S, D = 2, 3, 301, 64
    for dt, bits in ((torch.int16, 17), (torch.int8, 12), (torch.int8, 16)):
        x = _grid_ints(R, KV, S + 20, D, bits=bits).clamp(-(2 ** 17), 2 ** 17)
        bufs = [torch.zeros(R, KV, S + 20, D, dtype=dt), torch.zeros(R, KV, S + 20, dtype=torch.int8)]
        kbufs = [torch.zeros(R, KV, S + 20, D, dtype=dt), torch.zeros(R, KV, S + 20, dtype=attn16.SIDES[dt][0])]
        kref = [b.clone() for b in kbufs]
        attn16.store(x, [0, 0], *kbufs)
        attn16.store(x, [0, 0], *kref, fallback=True)
        assert torch.equal(kbufs[0], kref[0]) and torch.equal(kbufs[1], kref[1])
        ref = [b.clone() for b in bufs]
        attn16.store(x, [0, 0], *bufs)
        attn16.store(x, [0, 0], *ref, fallback=True)
        assert torch.equal(bufs[0], ref[0]) and torch.equal(bufs[1], ref[1])
        k, ks = kbufs[0][:, :, :S], kbufs[1][:, :, :S]  # K as the cache keeps it
        v, vs = bufs[0][:, :, :S], bufs[1][:, :, :S]  # V
        for G in (1, 3, 7, 13, attn16.DIRECT_MAX + 1):
            q = _grid_ints(R, KV, G, D, bits=14, seed=G)
            assert torch.equal(attn16.scores(q, k, ks), attn16.scores(q, k, ks, fallback=True)), (dt, G)
            g = torch.Generator().manual_seed(G)
            p = torch.round(torch.rand(R, KV, G, S, generator=g, dtype=torch.float64) * 2 ** 20)
            p[..., ::5] = 0.0
            assert torch.equal(attn16.weighted(p, v, vs), attn16.weighted(p, v, vs, fallback=True)), (dt, G)
