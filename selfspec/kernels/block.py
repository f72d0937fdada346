"""Every decoder layer of a narrow exact round in one C call (`block.c`): the kernels the Python
layer loop calls, called by C in the same order with the same arguments, so the same bits; the
loop's own overhead (ctypes calls, tensor allocations and views) goes.

    weights = weights_of(ff.layers, ff.norm, ff.grids)  # pointers and grids, once per model (None: not w4a8)
    out = run(weights, h, positions, ...)     # the final norm's output, or None (the loop runs)

It runs where every piece would run as one C call anyway: w4a8 weights (fused q/k/v and gate/up),
the compact cache's one-call attention (`attn16.direct`: a round of up to 32 tokens here), the
layer steps' C kernels, a CPU; elsewhere the caller keeps its loop (`available`).
"""

from __future__ import annotations

import ctypes

import torch

from selfspec.kernels import attn16, build, w4a8

_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class _Kernels(ctypes.Structure):
    _fields_ = [(n, _P) for n in ("direct", "rms", "add_rms", "rope", "silu_mul", "linear")]


_ARGS = [_P, _I, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _I, _P, _I, _I, _P, _P, _D, _D,
         _P, _P, _P, _P, _P, _I, ctypes.c_int, ctypes.c_int]
_state: dict = {}


def _entry():
    """(block_layers, the kernels' pointer struct), or None where a library is missing."""
    if "fn" not in _state:
        fn, libs = None, [build.load(n) for n in ("block", "w4a8", "attn16", "layer")]
        if all(lib is not None for lib in libs):
            blk, wl, al, ll = libs
            ptr = lambda f: ctypes.cast(f, _P).value  # noqa: E731
            kn = _Kernels(ptr(al.attn16_direct), ptr(ll.layer_rms), ptr(ll.layer_add_rms), ptr(ll.layer_rope),
                          ptr(ll.layer_silu_mul), ptr(wl.w4a8_linear_lora))
            fn = blk.block_layers
            fn.argtypes, fn.restype = _ARGS, ctypes.c_int
            _state["kn"] = kn
        _state["fn"] = fn
    return _state["fn"]


def weights_of(layers, norm: torch.Tensor, grids):
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


def available() -> bool:
    return _entry() is not None


def lora_of(tables) -> tuple:
    """The pointer arrays of a draft LoRA's modules (`checkpoint.lora.DraftLoRA.block_args`: [(A, B)
    int8 tables (`w4a8.pack_lora`) or None] x 7 per layer, q k v o gate up down): (pointers to A,
    its scales, B, its scales [28 L], ranks [7 L], the tensors)."""
    ptrs, ranks, keep = [], [], []
    for ab in tables:
        ts = [] if ab is None else [ab[0].packed, ab[0].scale, ab[1].packed, ab[1].scale]
        ptrs += [t.data_ptr() for t in ts] or [0] * 4
        ranks.append(0 if ab is None else ab[0].shape[0])
        keep += ts
    return (_P * len(ptrs))(*ptrs), (_I * len(ranks))(*ranks), keep


def run(weights, h: torch.Tensor, positions: torch.Tensor, tables, R: int, w: int, nq: int, kv: int, D: int,
        cache, row: int, starts: list[int], mask, rope_vscale: float, eps: float, lora=None) -> torch.Tensor | None:
    """All layers over h [R w, H] fp32 (the residual stream, updated in place) -> the final norm's
    output [R w, H] fp32; None where the one-call attention would not run (the caller's loop then
    does the same in steps). `cache`: a compact `engine.cache.BatchKVCache` (K / V [rows, KV, cap,
    D] int16 per layer, their shifts [rows, KV, cap] int8); row: the first of its rows. `lora`: a
    draft LoRA's (`lora_of`, flat draft rows int64) or None. A one-byte cache (int8 K / V) runs too."""
    fn = _entry()
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
    if fn(at(_state["kn"]), len(cache.k), R, w, H, nq, kv, D, F, at(ws), at(norms), at(nxt), at(kvp), at(grid), crs,
          chs, srs, shs, at(st), max(starts) + w, mp, mrs, mts, positions.data_ptr(), at(tab), rope_vscale, eps,
          h.data_ptr(), out.data_ptr(), None if lora is None else at(lora[0][0]),
          None if lora is None else at(lora[0][1]), None if lora is None else lora[1].data_ptr(),
          0 if lora is None else int(lora[1].shape[0]), torch.get_num_threads(), kb):
        raise MemoryError("block: out of memory for a layer's scratch")
    return out
