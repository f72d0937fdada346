"""The exact formats' layer in C: its elementwise steps (`layer.c`), one C call each where torch
runs five to fifteen small ops, with the same numerics in torch ops (the fallback, `fallback=True`;
tests compare the bits), and every layer of a narrow round in one C call (`block.c`, `run_block`).
`layer.c`'s header gives every step's sequence of IEEE operations; the token choice after the head
(argmax, gumbel_candidates, uniforms) calls `sample.c`.

    y = rms(h, w, eps)                  # h [M, H] fp32 -> bf16 [M, H] (out_dtype fp32: the final norm)
    y = add_rms(h, o, w, eps)           # h += o (in place), then rms(h)
    x = rope(qkv, pos, tables, nq, nk, vscale)   # bf16 [M, heads x D] -> float64 grid integers [M, heads, D]
    m = silu_mul(g, u)                  # bf16 [M, F] each -> bf16 [M, F]
    t = argmax(logits, banned)          # bf16 [M, V] -> int64 [M]: torch's argmax with `banned` at -inf
    w = block_weights(ff.layers, ff.norm, ff.grids)  # pointers and grids, once per model (None: not w4a8)
    out = run_block(w, h, positions, ...)   # every layer: the final norm's output, or None (the loop runs)

Example (rms): h = [[3., 4.]], w = [1., 1.], eps = 0 -> ss = 25, r = 1 / sqrt(12.5), y = [[0.8485, 1.1314]]
(in bf16: [[0.84765625, 1.1328125]]).
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from selfspec.kernels import attn16, build, w4a8

_P, _I64, _D, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int
_SIGS = {
    "layer_rms": [_P, _I64, _I64, _P, _D, _P, _INT, _INT],
    "layer_add_rms": [_P, _P, _I64, _I64, _P, _D, _P, _INT, _INT],
    "layer_rope": [_P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _D, _P, _INT],
    "layer_silu_mul": [_P, _P, _I64, _I64, _I64, _P, _INT],
    "layer_set_par_min": [_I64],
    "sample_argmax_bf16": [_P, _I64, _I64, _I64, _P, _I64],  # sample.c: choosing tokens from the logits
    "sample_gumbel_candidates": [_P, _INT, _I64, _I64, _I64, _P, _P, _P, _I64, _I64, _P, _P, _P, _P, _P, _INT],
    "sample_uniforms": [ctypes.c_uint64, _I64, _P],
}
_fns: dict = {}
CANDIDATES_MAX = 4  # a row where over 1/4 of the tokens may win takes the full draw (`gumbel_candidates`)


def _fn(name: str):
    fn = _fns.get(name, False)
    if fn is False:
        lib = build.load(name.split("_", 1)[0])  # layer.c's steps, or sample.c's token choice
        fn = None if lib is None else getattr(lib, name)
        if fn is not None:
            fn.argtypes, fn.restype = _SIGS[name], {"sample_gumbel_candidates": _I64, "layer_set_par_min": _I64,
                                                    "sample_argmax_bf16": _I64}.get(name)
        _fns[name] = fn
    return fn


def available() -> bool:
    """Whether the C steps run here (else every step runs its torch twin)."""
    return _fn("layer_rms") is not None


def _c(fallback: bool, name: str, *tensors) -> object:
    """The C entry point when it may run on these tensors (CPU, contiguous, no autograd), else None.
    Called several times a layer: plain attribute reads only (a tensor op costs microseconds)."""
    if fallback:
        return None
    grad = torch.is_grad_enabled()
    for t in tensors:
        if not (t.is_cpu and t.is_contiguous()) or grad and t.requires_grad:
            return None
    fn = _fns.get(name, False)
    return _fn(name) if fn is False else fn


# -- rms ------------------------------------------------------------------------------------------------
def _rms_torch(h: torch.Tensor, w: torch.Tensor, eps: float, out_dtype) -> torch.Tensor:
    xd = h.double()
    ss = (xd * xd).cumsum(-1)[..., -1:]  # float64, in index order: C's loop
    r = 1.0 / torch.sqrt(ss / h.shape[-1] + eps)
    return ((xd * r).float() * w).to(out_dtype)


def rms(h: torch.Tensor, w: torch.Tensor, eps: float, *, out_dtype=torch.bfloat16, fallback: bool = False):
    """RMSNorm of fp32 rows h [M, H] with fp32 weight w [H] -> [M, H] in `out_dtype` (bf16 / fp32)."""
    fn = _c(fallback, "layer_rms", h, w)
    if fn is None or h.dim() != 2 or h.dtype is not torch.float32 or w.dtype is not torch.float32:
        return _rms_torch(h, w, eps, out_dtype)
    M, H = h.shape
    out = torch.empty((M, H), dtype=out_dtype)
    fn(h.data_ptr(), M, H, w.data_ptr(), eps, out.data_ptr(), out_dtype is torch.bfloat16, torch.get_num_threads())
    return out


def add_rms(h: torch.Tensor, o: torch.Tensor, w: torch.Tensor, eps: float, *, out_dtype=torch.bfloat16,
            fallback: bool = False):
    """h += o (fp32 residual h [M, H], bf16 o, in place), then `rms(h)`."""
    fn = _c(fallback, "layer_add_rms", h, o, w)
    if (fn is None or h.dim() != 2 or h.dtype is not torch.float32 or o.dtype is not torch.bfloat16
            or w.dtype is not torch.float32 or o.shape != h.shape):
        h.add_(o)
        return _rms_torch(h, w, eps, out_dtype)
    M, H = h.shape
    out = torch.empty((M, H), dtype=out_dtype)
    fn(h.data_ptr(), o.data_ptr(), M, H, w.data_ptr(), eps, out.data_ptr(), out_dtype is torch.bfloat16,
       torch.get_num_threads())
    return out


# -- RoPE onto the attention grids --------------------------------------------------------------------
def rope(x: torch.Tensor, pos: torch.Tensor, tables, nq: int, nk: int, vscale: float, *,
         fallback: bool = False) -> torch.Tensor:
    """The fused q/k/v projection x [M, (nq + nk + nv) D] bf16 at positions pos [M] (int64) ->
    float64 grid integers [M, nq + nk + nv, D]: rint(x cos + roll(x, D/2) sin) with `tables`
    (q_cos, q_sin, k_cos, k_sin: float64 [positions, D], sin signed for the rolled half) on the
    query and key heads, and x times `vscale` on the value heads."""
    q_cos, q_sin, k_cos, k_sin = tables
    D = q_cos.shape[-1]
    M, heads = x.shape[0], x.shape[-1] // D
    fn = _c(fallback, "layer_rope", x, pos, *tables)
    if fn is None or x.dtype != torch.bfloat16 or q_cos.dtype != torch.float64:
        nv = heads - nq - nk
        cos = torch.cat([q_cos[pos, None].expand(M, nq, D), k_cos[pos, None].expand(M, nk, D),
                         torch.full((M, nv, D), vscale, dtype=torch.float64)], 1)
        sin = torch.cat([q_sin[pos, None].expand(M, nq, D), k_sin[pos, None].expand(M, nk, D),
                         torch.zeros(M, nv, D, dtype=torch.float64)], 1)
        xd = x.double().view(M, heads, D)
        return (xd * cos + xd.roll(D // 2, -1) * sin).round_()
    out = torch.empty(M, heads, D, dtype=torch.float64)
    fn(x.data_ptr(), pos.data_ptr(), M, nq, nk, heads - nq - nk, D, *(t.data_ptr() for t in tables), vscale,
       out.data_ptr(), torch.get_num_threads())
    return out


# -- the MLP's gate ------------------------------------------------------------------------------------------
SILU_LO, SILU_HI = -87.0, 88.0
INV_LN2F, LN2_HIF, LN2_LOF = 1.44269502162933349609375, 0.693359375, -2.12194440160132944584e-4
SILU_C = (1.0, 1.0, 0.5, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040)


def _f32(c: float) -> float:
    return float(torch.tensor(c, dtype=torch.float32))


SILU_C32 = tuple(_f32(c) for c in SILU_C)  # the fp32 constants layer.c's literals round to
LN2_LOF32 = _f32(LN2_LOF)


def exp_silu(y: torch.Tensor) -> torch.Tensor:
    """e^y of fp32 y clamped to [-87, 88], the same bits as `layer.c`'s exp_silu: k = rint(y / ln 2),
    r = (y - k ln2_hi) - k ln2_lo, a degree-7 Taylor polynomial by Horner's rule, times 2^k."""
    y = y.clamp(SILU_LO, SILU_HI)
    k = torch.round(y * INV_LN2F)
    r = (y - k * LN2_HIF) - k * LN2_LOF32
    p = torch.full_like(r, SILU_C32[7])
    for c in SILU_C32[6::-1]:
        p = p * r + c
    return p * ((k.to(torch.int32) + 127) << 23).view(torch.float32)


def silu_mul(g: torch.Tensor, u: torch.Tensor, *, fallback: bool = False) -> torch.Tensor:
    """silu(g) * u of bf16 g, u [M, F] (rows may be strided: the halves of one [M, 2F] tensor) -> bf16 [M, F]."""
    F = g.shape[-1]
    ok = (g.dim() == 2 and g.shape == u.shape and g.stride(1) == u.stride(1) == 1 and g.stride(0) == u.stride(0)
          and g.dtype is u.dtype is torch.bfloat16 and g.is_cpu
          and not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad)))
    fn = _c(fallback, "layer_silu_mul") if ok else None  # rows may be strided: checked here, not by _c
    if fn is None:
        x = g.float()
        return (x / (1.0 + exp_silu(-x))).to(torch.bfloat16) * u
    out = torch.empty(g.shape[0], F, dtype=torch.bfloat16)
    fn(g.data_ptr(), u.data_ptr(), g.shape[0], F, g.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


# -- the draft LoRA's delta -------------------------------------------------------------------------------
def argmax(logits: torch.Tensor, banned: int | None = None, *, fallback: bool = False) -> torch.Tensor:
    """logits [M, V] -> int64 [M]: each row's first largest entry, `banned` counted as -inf (the
    greedy target's token; `drafting.sampling.select` at temperature 0 gives the same). bf16 rows in
    one C pass (torch's bf16 argmax is slower than its float32 copy's, and that copy costs too);
    rows holding a NaN, other dtypes and the fallback: torch."""
    fn = None if logits.dtype != torch.bfloat16 or logits.dim() != 2 else _c(fallback, "sample_argmax_bf16", logits)
    if fn is None:  # drafting.sampling.ban_token's steps: kernels sit below drafting and keep their own twin
        x = logits.float()
        if banned is not None:
            x = x.clone()
            x[..., banned] = float("-inf")
        return x.argmax(-1)
    M, V = logits.shape
    out = torch.empty(M, dtype=torch.long)
    # rows with a NaN, counted in C: a tensor test of `out` right after the forward ran cold
    if fn(logits.data_ptr(), M, V, -1 if banned is None else banned, out.data_ptr(), torch.get_num_threads()):
        bad = out < 0
        out[bad] = argmax(logits[bad], banned, fallback=True)
    return out


class Candidates(NamedTuple):
    """`gumbel_candidates`' answer: (row, token) pairs in index order, each pair's logit as float64
    and its uniform, and (flat=True) the rows that declined, else None."""

    rows: torch.Tensor
    tokens: torch.Tensor
    logits: torch.Tensor
    uniforms: torch.Tensor
    flat: torch.Tensor | None


def gumbel_candidates(x: torch.Tensor, u: torch.Tensor | None, rows: torch.Tensor, seeds: torch.Tensor | None = None,
                      *, flat: bool = False, banned: int | None = None, fallback: bool = False) -> Candidates | None:
    """The (row, token) pairs of float32 or bf16 logits x [M, V] (`banned`: a token read as -inf,
    as `drafting.sampling.ban_token` makes it, without its copy) that may win the Gumbel-max draw
    with the uniforms u [p, V] (row r's: u[rows[r]]; u None: those `uniforms` makes from `seeds`
    [p], each made where it is read): a superset of every row's winner, in index order, with each
    pair's logit and uniform (`drafting.sampling.gumbel_argmax` makes their noisy values): the
    tokens whose logit with their own noise may reach the noisy value of the row's first largest
    logit (libm's logs, with a margin), looked for in the blocks of 64 whose largest logit with the
    position's largest noise, then with the block's own, may reach it. The kernel makes each
    position's largest uniforms, of all and of each block (its whole row read or made once; the
    positions, then the rows, shared out over torch's threads). A few C passes
    a row; None (the caller computes every token) without the C steps, for other dtypes, a NaN or
    a row where more than 1/CANDIDATES_MAX of the tokens pass (the full computation is cheaper
    then). flat=True: such rows decline alone (`flat` [M] bool), with none of their pairs."""
    side = u if u is not None else seeds
    ok = (x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and side is not None
          and side.dtype is (torch.float64 if u is not None else torch.int64))
    fn = _c(fallback, "sample_gumbel_candidates", x, side, rows) if ok and rows.dtype is torch.long else None
    if fn is None:
        return None
    M, V = x.shape
    if banned is not None and not -V <= banned < V:  # out of range: torch's indexing says so
        return None
    cap = M * (V // CANDIDATES_MAX)
    cr, cc = torch.empty(cap, dtype=torch.long), torch.empty(cap, dtype=torch.long)
    cx, cu = torch.empty(cap, dtype=torch.float64), torch.empty(cap, dtype=torch.float64)
    declined = torch.empty(M, dtype=torch.int8) if flat else None  # the kernel writes every row's flag
    n = fn(x.data_ptr(), x.dtype is torch.bfloat16, -1 if banned is None else banned % V, M, V,
           None if u is None else u.data_ptr(), None if u is not None else seeds.data_ptr(),
           rows.data_ptr(), side.shape[0], V // CANDIDATES_MAX, cr.data_ptr(), cc.data_ptr(), cx.data_ptr(),
           cu.data_ptr(), None if declined is None else declined.data_ptr(), torch.get_num_threads())
    if n < 0:
        return None
    return Candidates(cr[:n], cc[:n], cx[:n], cu[:n], None if declined is None else declined.bool())


def uniforms(seed: int, V: int) -> torch.Tensor | None:
    """A position's V float64 uniforms in (0, 1) from its 64-bit `seed` (splitmix64 per index, one
    C pass, far cheaper than torch.rand's generator); None without the C steps
    (`drafting.sampling.splitmix_uniforms` makes the same bits in torch ops)."""
    fn = _fn("sample_uniforms")
    if fn is None:
        return None
    u = torch.empty(V, dtype=torch.float64)
    fn(seed & (2**64 - 1), V, u.data_ptr())
    return u


# -- every layer in one C call (`block.c`) ----------------------------------------------------------
# The kernels the Python layer loop calls, called by C in the same order with the same arguments, so
# the same bits; the loop's own overhead (ctypes calls, tensor allocations and views) goes. It runs
# where every piece would run as one C call anyway: w4a8 weights (fused q/k/v and gate/up), the
# compact cache's one-call attention (`attn16.direct`), the layer steps' C kernels, a CPU; elsewhere
# the caller keeps its loop (`block_available`).


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("direct", "rms", "add_rms", "rope", "silu_mul", "linear")]


_BLOCK_ARGS = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P,
               _I64, _P, _I64, _I64, _P, _P, _D, _D, _P, _P, _P, _P, _P, _I64, ctypes.c_int, ctypes.c_int]
_block_state: dict = {}


def _block_entry():
    """(block_layers, the kernels' pointer struct), or None where a library is missing."""
    if "fn" not in _block_state:
        fn, libs = None, [build.load(n) for n in ("block", "w4a8", "attn16", "layer")]
        if all(lib is not None for lib in libs):
            blk, wl, al, ll = libs
            ptr = lambda f: ctypes.cast(f, _P).value  # noqa: E731
            kn = _Kernels(ptr(al.attn16_direct), ptr(ll.layer_rms), ptr(ll.layer_add_rms), ptr(ll.layer_rope),
                          ptr(ll.layer_silu_mul), ptr(wl.w4a8_linear_lora))
            fn = blk.block_layers
            fn.argtypes, fn.restype = _BLOCK_ARGS, ctypes.c_int
            _block_state["kn"] = kn
        _block_state["fn"] = fn
    return _block_state["fn"]


def block_weights(layers, norm: torch.Tensor, grids):
    """The pointer arrays of a model's layers (`engine.forward.LayerWeights`) when every matmul is
    w4a8 with fused q/k/v and gate/up and the norms are fp32 on the CPU, else None: (weights
    [4 L], norms [2 L] (ln1 of layer 0, ln2 of layer 0, 0, ln2 of layer 1, ...), the norm each
    layer ends with [L], the MLP width F, the attention grids [3 L] (scale, shift, 2^v), the
    tensors they point into)."""
    ws, keep = [], []
    for lw in layers:
        mats = [m[0] if isinstance(m, tuple) and len(m) == 1 else m for m in (lw.qkv, lw.wo, lw.gate_up, lw.down)]
        if not all(isinstance(m, w4a8.W4A8Weight) for m in mats):
            return None
        ws += [m.packed.data_ptr() for m in mats]
        keep += [m.packed for m in mats]
    ln2, nxt = [lw.ln2 for lw in layers], [lw.ln1 for lw in layers[1:]] + [norm]
    if not all(t.dtype is torch.float32 and t.is_contiguous() and t.is_cpu for t in ln2 + nxt + [layers[0].ln1]):
        return None
    norms = [p for i, t in enumerate(ln2) for p in (layers[0].ln1.data_ptr() if i == 0 else 0, t.data_ptr())]
    arr = lambda xs: (_P * len(xs))(*xs)  # noqa: E731
    grid = (ctypes.c_double * (3 * len(grids)))(*[x for g in grids for x in (g.scale, g.shift, 2.0 ** g.v)])
    return (arr(ws), arr(norms), arr([t.data_ptr() for t in nxt]), layers[0].gate_up[0].shape[0] // 2, grid,
            keep + ln2 + nxt)


def _cache_layout(cache, row: int):
    """(strides, per-layer K / V / shift pointers of cache row `row` [4 L]) of a compact cache, or
    None where its layers differ in layout (the C side assumes one); made once per cache shape
    and row (in `cache.scratch`: a cache that grows gets new tensors and a new shape)."""
    memo = cache.scratch.get(("block", row))
    if memo is not None and memo[0] == cache.shape:
        return memo[1]
    ks, vs, shifts = cache.k, cache.v, cache.shifts
    k0, s0 = ks[0], shifts[0]
    out = None
    if (attn16._ok(k0, s0, attn16.K) and all(t.stride() == k0.stride() and t.dtype is k0.dtype for t in ks + vs)
            and all(t.stride() == s0.stride() for t in shifts)):
        crs, srs, kb, sb = k0.stride(0), s0.stride(0), k0.element_size(), s0.element_size()  # sb: K's side array
        ptrs = [p for i in range(len(ks)) for p in (ks[i].data_ptr() + kb * row * crs,
                                                     vs[i].data_ptr() + kb * row * crs,
                                                     shifts[2 * i].data_ptr() + sb * row * srs,
                                                     shifts[2 * i + 1].data_ptr() + row * srs)]
        out = ((crs, k0.stride(1), srs, s0.stride(1), kb), (_P * len(ptrs))(*ptrs))
    cache.scratch[("block", row)] = (cache.shape, out)
    return out


def block_available() -> bool:
    """Whether the one-call block runs here (its library and the kernels it calls built)."""
    return _block_entry() is not None


def block_lora(tables) -> tuple:
    """The pointer arrays of a draft LoRA's modules (`checkpoint.lora.DraftLoRA.block_args`: [(A, B)
    int8 tables (`w4a8.pack_lora`) or None] x 7 per layer, q k v o gate up down): (pointers to A,
    its scales, B, its scales [28 L], ranks [7 L], the tensors)."""
    ptrs, ranks, keep = [], [], []
    for ab in tables:
        ts = [] if ab is None else [ab[0].packed, ab[0].scale, ab[1].packed, ab[1].scale]
        ptrs += [t.data_ptr() for t in ts] or [0] * 4
        ranks.append(0 if ab is None else ab[0].shape[0])
        keep += ts
    return (_P * len(ptrs))(*ptrs), (_I64 * len(ranks))(*ranks), keep


def run_block(weights, h: torch.Tensor, positions: torch.Tensor, tables, R: int, w: int, nq: int, kv: int, D: int,
        cache, row: int, starts: list[int], mask, rope_vscale: float, eps: float, lora=None) -> torch.Tensor | None:
    """All layers over h [R w, H] fp32 (the residual stream, updated in place) -> the final norm's
    output [R w, H] fp32; None where the one-call attention would not run (the caller's loop then
    does the same in steps). `cache`: a compact `engine.cache.BatchKVCache` (K / V [rows, KV, cap,
    D] int16 per layer, their shifts [rows, KV, cap] int8); row: the first of its rows. `lora`: a
    draft LoRA's (`block_lora`, flat draft rows int64) or None. A one-byte cache (int8 K / V) runs too."""
    fn = _block_entry()
    if (fn is None or not attn16.direct_fits(R, kv, (nq // kv) * w, max(starts) + w) or cache.shape[0] < row + R
            or max(starts) + w > cache.shape[2]
            or mask is not None and not (mask.dtype is torch.float64 and mask.stride(-1) == 1)
            or not (positions.dtype is torch.int64 and positions.is_contiguous())):
        return None
    layout = _cache_layout(cache, row)
    if layout is None:
        return None
    (crs, chs, srs, shs, kb), kvp = layout
    ws, norms, nxt, F, grid, _ = weights
    M, H = h.shape
    st = (ctypes.c_int64 * R)(*starts)
    tab = (_P * 4)(*(t.data_ptr() for t in tables))
    out = torch.empty(M, H, dtype=torch.float32)
    mp, mrs, mts = attn16._mask_args(mask)
    at = ctypes.addressof
    if fn(at(_block_state["kn"]), len(cache.k), R, w, H, nq, kv, D, F, at(ws), at(norms), at(nxt), at(kvp), at(grid),
          crs, chs, srs, shs, at(st), max(starts) + w, mp, mrs, mts, positions.data_ptr(), at(tab), rope_vscale, eps,
          h.data_ptr(), out.data_ptr(), None if lora is None else at(lora[0][0]),
          None if lora is None else at(lora[0][1]), None if lora is None else lora[1].data_ptr(),
          0 if lora is None else int(lora[1].shape[0]), torch.get_num_threads(), kb):
        raise MemoryError("block: out of memory for a layer's scratch")
    return out
