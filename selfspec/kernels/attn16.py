"""The exact attention's matmuls over the compact cache, read in place (`attn16.c`).

    s = scores(q, k, k_shift)      # q [R, KV, G, D] float64 grid integers, k [R, KV, S, D] int16
    o = weighted(p, v, v_shift)    # p [R, KV, G, S] float64 integers -> [R, KV, G, D]

Both are exact integer sums, so the C kernels and the torch fallback (decompress, then
`torch.matmul`) give the same bits. Scores round each query row first (`round_q`, 10 bits): the C
kernel then sums int16 products in int32 at any width (`attn16_scores.h`), reading the cache in
place. Weighted sums are exact integers too: in int32 lanes where the CPU has AVX-512 VNNI and a
key head's V shifts agree (`attn16_words.h`: key pairs' weights as 10-bit limbs, one instruction
per pair, query and sixteen dimensions), else in float64 tiles (`attn16_avx2.h`, `attn16_avx512.h`), the same bits.
Up to `DIRECT_MAX` queries per key head (AR and rounds of up to 32 tokens on the default model,
whose layers run in one C call, `block.c`) the kernel reads the int16 cache in place, a quarter of
the float64 cache's bytes. Wider rounds (a prefill's chunks) do too where the kernel has AVX-512
tiles (twice the speed of torch's float64 GEMM of this skinny shape, `attn16_pv_wide`); elsewhere
they decompress into a reused buffer in one C pass and run torch's GEMM.

The one-byte cache runs through the same calls: K as int8 times an integer scale per token and
head (`compress_scaled`, int32 scales), V as int8 times a power of two (`compress(x, torch.int8)`);
the kernels widen both to int16 in registers (V times its 2^shift, exact up to shift 8; K's scale
multiplies its scores), so the same exact integer sums read half the bytes.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from selfspec.kernels import build

_P, _I = ctypes.c_void_p, ctypes.c_int64
_C = ctypes.c_int
_ARGS = [_P, _I, _I, _I, _I, _P, _I, _I, _P, _I, _I, _I, _P, _C, _C]


_STORE = [_P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _C]
_DECOMPRESS = [_P, _I, _I, _I, _I, _I, _I, _P, _I, _I, _P, _C, _C]
_D = ctypes.c_double
_WEIGHTS = [_P, _I, _I, _I, _I, _I, _P, _I, _I, _D, _D, _D, _P, ctypes.c_int]
_EXP = [_P, _I]
_OUT = [_P, _P, _I, _I, _I, _I, _I, _P]
_DIRECT = [_P, _I, _I, _I, _I, _I, _P, _I, _P, _P, _I, _I, _P, _P, _I, _I, _P, _I, _I, _D, _D, _D, _P, _C, _C]
# queries per key head read in place (rounds of up to 32 tokens here; 48 until a linear one-pass
# round of 20 tokens was measured: forwards of 20 and 32 tokens ran faster in place at every cache
# length tried); wider ones decompress once and run a GEMM
DIRECT_MAX = 96
# ... and where the weighted sums have AVX-512 tiles (`_pv_wide`): a prefill's pieces of 128 tokens
# (384 queries a key head on the default model, 512 with four query heads a key head) run in one
# call too (a long prefill ran faster so than in per-layer steps with the tiles)
DIRECT_MAX_WIDE = 512
DIRECT_SCORES = 1 << 25  # at most this many scores (float64) in one call's kept scratch: 256 MiB
_scratch = threading.local()
_PV_WIDE: bool | None = None  # `_pv_wide()`, once known


def direct_max() -> int:
    """Queries per key head a round may have to run in one C call here (`direct_fits`)."""
    return DIRECT_MAX_WIDE if _pv_wide() else DIRECT_MAX


def direct_fits(R: int, KV: int, G: int, S: int) -> bool:
    """Whether a round of R rows, G queries per key head over S keys runs in one C call
    (`direct`, `layer.run_block`): G within `direct_max()` and its scores within `DIRECT_SCORES` (the
    call keeps its scratch)."""
    return G <= direct_max() and R * KV * G * S <= DIRECT_SCORES


def _fn(name: str):
    fn = _fns.get(name, False)  # asked per layer and round: the library's lock taken once per entry point
    if fn is False:
        fn = _fns[name] = _load_fn(name)
    return fn


_fns: dict = {}


def _load_fn(name: str):
    lib = build.load("attn16")
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        fn.argtypes = {"attn16_store": _STORE, "attn16_store_k8": _STORE[:-1], "attn16_decompress": _DECOMPRESS,
                       "attn16_weights": _WEIGHTS,
                       "attn16_exp_round": _EXP, "attn16_out": _OUT, "attn16_direct": _DIRECT,
                       "attn16_pv_wide": [], "attn16_set_int_pv": [ctypes.c_int],
                       "attn16_set_par_min": [ctypes.c_int64]}.get(name, _ARGS)
        fn.restype = ctypes.c_int if name in ("attn16_direct", "attn16_scores", "attn16_pv", "attn16_pv_wide",
                                              "attn16_set_int_pv") else None
        if name == "attn16_set_par_min":
            fn.restype = ctypes.c_int64
    return fn


MANTISSA = {torch.int16: 15, torch.int8: 7}  # bits of a compact value's magnitude, by the cache's dtype
# the side arrays beside a compact cache's K and V values, by the values' dtype: shifts (int8), or the
# one-byte cache's K's integer scales (int32, `compress_scaled`)
SIDES = {torch.int16: (torch.int8, torch.int8), torch.int8: (torch.int32, torch.int8)}
K, V = 0, 1


def compress(x: torch.Tensor, dtype: torch.dtype = torch.int16) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid integers x [..., D] (float64) -> (m [..., D] in `dtype`, shift int8 [...]) with
    x ~= m * 2^shift: shift the least that fits the row's largest |x| below 2^15 (int16) or 2^7
    (int8, the one-byte cache), rounding half to even, clamped to +-(2^bits - 1).
    Example (int16): [40000., -3., 1.] -> shift 1, m [20000, -2, 0] (3 / 2 = 1.5 -> 2, 1 / 2 -> 0);
    (int8): [300., -3., 1.] -> shift 2, m [75, -1, 0]."""
    bits = MANTISSA[dtype]
    top = x.abs().amax(-1)
    shift = (torch.frexp(top).exponent - bits).clamp_(min=0)
    m = torch.round(x * torch.exp2(-shift.double())[..., None]).clamp_(-(2 ** bits - 1), 2 ** bits - 1)
    return m.to(dtype), shift.to(torch.int8)


def compress_scaled(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-byte cache's K: grid integers x [..., D] (float64) -> (m int8 [..., D], c int32 [...])
    with x ~= m * c: the integer scale c = max(1, ceil(max |x| / 127)), m = rint(x / c) (half to
    even) within +-127. Finer than a power of two (the largest value keeps 7 bits, not 6-7): a
    key's rounding moves the attention's scores most. Example: [300., -3., 1.] -> c 3, m [100, -1, 0]."""
    c = torch.ceil(x.abs().amax(-1) / 127.0).clamp_(min=1.0)
    m = torch.round(x / c[..., None]).clamp_(-127, 127)
    return m.to(torch.int8), c.to(torch.int32)


def store(x: torch.Tensor, starts: list[int], m: torch.Tensor, shift: torch.Tensor, *, fallback: bool = False):
    """Write x [R, KV, q, D] (float64 grid integers) compressed into cache views m [R, KV, cap, D]
    (int16, or int8: the one-byte cache) and shift [R, KV, cap] (int8; int32: the one-byte cache's K,
    integer scales, `compress_scaled`) at slots starts[r] .. starts[r] + q - 1 of each row."""
    scaled = shift.dtype == torch.int32  # the one-byte cache's K: integer scales
    fn = None if fallback or not (_ok(m, shift, K) or _ok(m, shift, V)) or x.stride(-1) != 1 else \
        _fn("attn16_store_k8" if scaled else "attn16_store")
    if fn is None:
        c, s = compress_scaled(x) if scaled else compress(x, m.dtype)
        q = x.shape[2]
        for r, st in enumerate(starts):
            m[r, :, st : st + q] = c[r]
            shift[r, :, st : st + q] = s[r]
        return
    R, KV, q, D = x.shape
    st = (ctypes.c_int64 * R)(*starts)
    kb = () if scaled else (m.element_size(),)  # attn16_store_k8 is the one-byte cache's alone
    fn(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), R, KV, q, D, ctypes.addressof(st), m.data_ptr(),
       m.stride(0), m.stride(1), shift.data_ptr(), shift.stride(0), shift.stride(1), *kb)


def decompress(m: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """int16 (or int8) m [..., D] and shifts [...] -> the float64 integers m * 2^shift; with int32
    scales (the one-byte cache's K) m * scale."""
    if shift.dtype == torch.int32:
        return m.double() * shift.double()[..., None]
    return m.double() * torch.exp2(shift.double())[..., None]


def _wide(m: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """m * 2^shift [R, KV, S, D] float64 (the values of a wide round's weighted sums) in this
    thread's reused buffer: a fresh allocation this size would cost page faults every layer."""
    R, KV, S, D = m.shape
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < m.numel():
        grown = 0 if buf is None else 2 * buf.numel()
        buf = _scratch.buf = torch.empty(max(m.numel(), grown), dtype=torch.float64)
    out = buf[: m.numel()].view(R, KV, S, D)
    _fn("attn16_decompress")(m.data_ptr(), R, KV, S, D, m.stride(0), m.stride(1), shift.data_ptr(), shift.stride(0),
                             shift.stride(1), out.data_ptr(), torch.get_num_threads(), m.element_size())
    return out


def _pv_wide() -> bool:
    """Whether the C weighted sums beat torch's float64 GEMM for wide rounds too (their AVX-512
    tiles): a property of the built library, asked once (every round's `direct_fits` reads it)."""
    global _PV_WIDE
    if _PV_WIDE is None:
        fn = _fn("attn16_pv_wide")
        _PV_WIDE = bool(fn is not None and fn())
    return _PV_WIDE


def _ok(x: torch.Tensor, shift: torch.Tensor, side: int) -> bool:
    """Whether the C kernels read K (side K) or V (side V) values x with their side array `shift` in place."""
    return (x.device.type == "cpu" and x.dtype in SIDES and shift.dtype == SIDES[x.dtype][side]
            and x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] and shift.stride(-1) == 1 and x.shape[-1] <= 256)


def q_bits(D: int) -> int:
    """Bits a rounded query keeps (`round_q`): a score's integer sum then stays below 2^31."""
    return 16 - (D - 1).bit_length()


def round_q(q: torch.Tensor) -> torch.Tensor:
    """Query rows [..., D] (float64 grid integers) as block floats of `q_bits(D)` bits: q' 2^s with
    s = max(0, e - bits), 2^(e-1) <= max |q| < 2^e, q' = rint(q 2^-s); `attn16.h`'s q_round,
    the same bits. A function of the row alone, so width-, batch- and cache-invariant; the scores
    of rounded rows are int16 dot products, exact in int32.

    Example: round_q of a row whose largest value is 3000 (e = 12) with D = 64 (10 bits) keeps
    multiples of 4: 1001 -> 1000, 1003 -> 1004."""
    _, e = torch.frexp(q.abs().amax(-1, keepdim=True))
    f = torch.pow(2.0, (e - q_bits(q.shape[-1])).clamp(min=0).to(torch.float64))
    return torch.round(q / f) * f


def scores(q: torch.Tensor, k: torch.Tensor, shift: torch.Tensor, *, fallback: bool = False) -> torch.Tensor:
    """q [R, KV, G, D] float64, k [R, KV, S, D] int16 or int8 (a view of the cache), shift
    [R, KV, S] int8 -> [R, KV, G, S] float64: round_q(q) @ (k * 2^shift)^T, exact (in C, int16
    products summed in int32, at every width: no float64 copy of the keys)."""
    fn = None if fallback or not _ok(k, shift, K) else _fn("attn16_scores")
    if fn is None:
        return torch.matmul(round_q(q), decompress(k, shift).transpose(-1, -2))
    R, KV, G, D = q.shape
    S = k.shape[2]
    q = q.contiguous()
    out = torch.empty(R, KV, G, S, dtype=torch.float64)
    if fn(q.data_ptr(), R, KV, G, D, k.data_ptr(), k.stride(0), k.stride(1), shift.data_ptr(), shift.stride(0),
          shift.stride(1), S, out.data_ptr(), torch.get_num_threads(), k.element_size()):
        raise MemoryError("attn16: out of memory for the rounded query rows")
    return out


def weighted(p: torch.Tensor, v: torch.Tensor, shift: torch.Tensor, *, fallback: bool = False) -> torch.Tensor:
    """p [R, KV, G, S] float64, v [R, KV, S, D] int16 or int8, shift [R, KV, S] -> [R, KV, G, D]
    float64: p @ (v * 2^shift), exact."""
    fn = None if fallback or not _ok(v, shift, V) else _fn("attn16_pv")
    if fn is None:
        return torch.matmul(p, decompress(v, shift))
    if p.shape[2] > DIRECT_MAX and not _pv_wide():
        return torch.matmul(p, _wide(v, shift))
    R, KV, G, S = p.shape
    D = v.shape[-1]
    p = p.contiguous()
    out = torch.empty(R, KV, G, D, dtype=torch.float64)
    if fn(p.data_ptr(), R, KV, G, D, v.data_ptr(), v.stride(0), v.stride(1), shift.data_ptr(), shift.stride(0),
          shift.stride(1), S, out.data_ptr(), torch.get_num_threads(), v.element_size()):
        raise MemoryError("attn16: out of memory for a one-byte cache's widened values")
    return out


# e^x as a fixed sequence of IEEE operations (`attn16.c`'s exp_round1, the same bits): Taylor to
# degree 7, the inner five Horner steps in float32, the last two in float64
LN2_HI, LN2_LO, INV_LN2 = 6.93147180369123816490e-01, 1.90821492927058770002e-10, 1.44269504088896338700e+00
EXP_C = (1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040)


def exp_round(x: torch.Tensor, *, fallback: bool = False) -> torch.Tensor:
    """rint(e^x) of float64 x (in place where the C kernel runs), 0 where x < -1 (e^-1 < 0.5) or
    x = -inf: k = rint(x / ln 2), r = (x - k ln2_hi) - k ln2_lo, e^r = 1 + r (1 + r q(r)) by
    Horner's rule (q in float32), times 2^k: within 0.5 + 2^-26 e^x of e^x. Not torch.exp: its
    vector body and scalar tail (and libm) need not agree in the last bit, and the exact
    attention's weights must be the same function of a score wherever it sits."""
    fn = None if fallback or not x.is_contiguous() or x.device.type != "cpu" else _fn("attn16_exp_round")
    if fn is not None:
        fn(x.data_ptr(), x.numel())
        return x
    xc = x.clamp(min=-1.0)
    k = torch.round(xc * INV_LN2)
    r = (xc - k * LN2_HI) - k * LN2_LO
    rf = r.float()
    q = torch.full_like(rf, EXP_C[7])
    for c in EXP_C[6:1:-1]:
        q = q * rf + c
    p = (q.double() * r + 1.0) * r + 1.0
    two_k = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return torch.where(x >= -1.0, torch.round(p * two_k), torch.zeros_like(x))


def weights(s: torch.Tensor, mask: torch.Tensor | None, w: int, scale: float, shift: float, vscale: float, *,
            fallback: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores s [R, KV, G, S] float64 (G = heads per key head x w) -> (P, den): the integer softmax
    weights P = rint(e^(s' - (max s' - shift))), s' = (s + mask) * scale, and den = sum P * vscale
    [R, KV, G, 1]; in place in one C call where it runs. mask: [R, 1, w, S] or [w, S] additive, or None."""
    R, KV, G, S = s.shape
    fn = None if fallback or not s.is_contiguous() or s.dtype != torch.float64 else _fn("attn16_weights")
    if fn is not None and (mask is None or (mask.dtype == torch.float64 and mask.stride(-1) == 1)):
        den = torch.empty(R, KV, G, 1, dtype=torch.float64)
        fn(s.data_ptr(), R, KV, G, S, w, *_mask_args(mask), scale, shift, vscale, den.data_ptr(),
           torch.get_num_threads())
        return s, den
    if mask is not None:  # broadcast over the heads of a group
        s = (s.view(R, KV, G // w, w, S) + mask.view(-1, 1, 1, w, S)).view(R, KV, G, S)
    s = s * scale
    top = s.amax(-1, keepdim=True)
    p = exp_round(s - (top - shift), fallback=True)
    return p, p.sum(-1, keepdim=True) * vscale


def _mask_args(mask: torch.Tensor | None) -> tuple:
    """(pointer, row stride, query stride) of a [R, 1, w, S] or [w, S] additive mask for the C kernels."""
    if mask is None:
        return None, 0, 0
    if mask.dim() == 2:
        return mask.data_ptr(), 0, mask.stride(0)
    return mask.data_ptr(), (mask.stride(0) if mask.shape[0] > 1 else 0), mask.stride(2)


def out(pv: torch.Tensor, den: torch.Tensor, w: int, *, fallback: bool = False) -> torch.Tensor:
    """pv [R, KV, J w, D] and den [R, KV, J w, 1] float64 (key head kv's J query heads, w queries
    each) -> pv / den in bf16 as [R, w, KV J D]: the heads side by side, what o_proj reads."""
    R, KV, G, D = pv.shape
    J = G // w
    fn = None if fallback or not (pv.is_contiguous() and den.is_contiguous() and pv.is_cpu) else _fn("attn16_out")
    if fn is None:
        return (pv / den).to(torch.bfloat16).view(R, KV * J, w, D).transpose(1, 2).reshape(R, w, KV * J * D)
    o = torch.empty(R, w, KV * J * D, dtype=torch.bfloat16)
    fn(pv.data_ptr(), den.data_ptr(), R, KV, J, w, D, o.data_ptr())
    return o


def direct(x: torch.Tensor, nq: int, starts: list[int], k: torch.Tensor, kshift: torch.Tensor, v: torch.Tensor,
           vshift: torch.Tensor, mask: torch.Tensor | None, scale: float, shift: float, vscale: float, *,
           row: int = 0):
    """One layer's exact attention for a narrow round in one C call, or None where it cannot run (no
    kernel, a wide round, layouts it does not read): x [R, w, nq + 2 KV, D] float64 (q, k and v heads
    on their grids); the new K and V stored at slots starts[r] .. of cache rows row + r of k / v
    [rows, KV, cap, D] (int16, or int8: the one-byte cache) with their shifts [rows, KV, cap] (K's int32
    scales in the one-byte cache); then `scores`, `weights`,
    `weighted` and `out` over slots 0 .. max(starts) + w - 1, the same calls in the same order
    (the same bits) -> bf16 [R, w, nq D]. mask as `weights` takes it."""
    R, w, heads, D = x.shape
    KV = (heads - nq) // 2
    if (not direct_fits(R, KV, (nq // KV) * w, max(starts) + w)
            or not (x.is_contiguous() and x.dtype is torch.float64 and x.is_cpu)):
        return None
    if not (_ok(k, kshift, K) and _ok(v, vshift, V) and k.dtype == v.dtype and k.stride() == v.stride()
            and kshift.stride() == vshift.stride() and k.shape[0] >= row + R):
        return None
    if mask is not None and not (mask.dtype is torch.float64 and mask.stride(-1) == 1):
        return None
    fn = _fn("attn16_direct")
    if fn is None:
        return None
    o = torch.empty((R, w, nq * D), dtype=torch.bfloat16)
    st = (ctypes.c_int64 * R)(*starts)
    crs, srs, kb = k.stride(0), kshift.stride(0), k.element_size()
    if fn(x.data_ptr(), R, w, nq, KV, D, ctypes.addressof(st), max(starts) + w, k.data_ptr() + kb * row * crs,
          v.data_ptr() + kb * row * crs, crs, k.stride(1), kshift.data_ptr() + kshift.element_size() * row * srs,
          vshift.data_ptr() + row * srs, srs, kshift.stride(1), *_mask_args(mask), scale, shift, vscale,
          o.data_ptr(), torch.get_num_threads(), kb):
        raise MemoryError("attn16: out of memory for the attention's scratch")
    return o
