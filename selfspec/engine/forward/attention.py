"""Attention whose result for a query row does not depend on anything but that row's visible keys.

A speculative round verifies a tree: the node at depth d attends to the prefix and its path,
whose keys sit at other cache slots, next to other queries and other rows than when AR computes
the same position one token at a time. A floating-point reduction over keys (softmax sum, P @ V)
rounds differently for every such layout, so a row's logits would move in their last bits with
the width of the round, and greedy output would equal AR only where no near-tie meets that
noise. Here every sum over keys is exact, so its order, its length and the zeros of masked keys
cannot matter:

* q and k are rounded to a grid of 2^-a (`Grid.qk`; the runtime's RoPE tables carry the scale)
  and multiplied in float64: every product and partial sum of a score is an integer below 2^53,
  so the score is exact; each query row is first rounded to a block float of 10 bits
  (`attn16.round_q`, a function of the row alone), which makes a score a sum of int16 products,
  exact in int32 too: the C kernels sum it so (`kernels/attn16_scores.h`), the same bits;
* P = round(exp(score * scale - max + p ln 2)) is an integer up to 2^p, a function of the row's
  own scores only (the max over its visible keys is exact; the exponential is a fixed sequence
  of IEEE operations, `kernels.attn16.exp_round`, the same in C and in torch wherever the score
  sits in the tensor);
* V lies on a grid of 2^-b (`Grid.v`): P @ V and the sum of P are integers below 2^53: exact;
* out = (P @ V) / (sum P * 2^b), one correctly rounded division.

The bounds that keep every partial sum below 2^53 come from the weights (`grid_for`): |q|, |k|
and |v| of a layer are at most a row norm of its projection times the largest RMSNorm weight
times sqrt(hidden). Elementwise ops (exp, round, the division) are deterministic per element, and
the projections before and after are bf16 / int8 / int4 kernels that are bitwise invariant in the
number of rows (tested per op and for the whole forward: `tests/test_invariance.py`).

The cache keeps K and V compact: per token and key head, the 64 grid integers as
int16 times one power of two (2^shift, shift >= 0, the smallest that fits the token's largest
value in 15 bits: `kernels.attn16.compress`). A token whose values fit stays exact on the grid; a larger one keeps 15
significant bits, as a block float. Decompressed (`from_block16`) they are integers on the same
grid again, within the bounds the grid was made for, so every sum above stays exact: what the
rounding costs is measured as any weight format's quality is (`formats.measure`), never paid in
exactness. 2 bytes a value plus 1 a token and head (against 8 as float64); the one-byte cache
(`kv_cache_dtype="int8"`) keeps K as int8 times an integer scale per token and head (ceil(max /
127): integers again) and V as int8 times a power of two, 1 byte a value.

Cost: the two matmuls run in float64 on small tensors, about what bf16 SDPA costs at one query
row on a CPU, more for wide rounds (`python -m selfspec bench quality`).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from selfspec.kernels import attn16

EXACT = 52  # bits an exact float64 partial sum may use (of 53)
P_BITS = 20  # P = round(exp(s - max) * 2^20): weights below 2^-21 of the largest key's are dropped


@dataclass(frozen=True)
class Grid:
    """Grid exponents of one layer: q and k on multiples of 2^-qk, v on multiples of 2^-v."""

    qk: int
    v: int
    scale: float  # softmax scale (head_dim ** -0.5) over the grid's 2^-2qk

    @property
    def shift(self) -> float:
        return P_BITS * math.log(2.0)


def grid_for(head_dim: int, q_bound: float, k_bound: float, v_bound: float, max_keys: int) -> Grid:
    """Exponents that keep every partial sum exact: a score sums head_dim products of two grid
    integers; P @ V sums max_keys products of P (< 2^P_BITS + 1) and a v integer.

    Example: head_dim 64, |q|, |k| <= 100, |v| <= 30, 8192 keys -> qk = 16, v = 13."""
    bits = lambda x: max(0, math.ceil(math.log2(max(x, 1e-30))))  # noqa: E731
    qk = (EXACT - bits(head_dim) - bits(q_bound) - bits(k_bound)) // 2
    v = EXACT - (P_BITS + 1) - bits(max_keys) - bits(v_bound)
    if qk < 4 or v < 4:
        raise ValueError(f"an exact attention grid needs smaller activations (|q| <= {q_bound:.3g}, |k| <= "
                         f"{k_bound:.3g}, |v| <= {v_bound:.3g} over {max_keys} keys leave 2^-{qk} / 2^-{v})")
    return Grid(qk, v, head_dim ** -0.5 / 4.0 ** qk)


def on_grid(x: torch.Tensor, exponent: int) -> torch.Tensor:
    """x as float64 integers: round(x * 2^exponent)."""
    return torch.round(x.double() * 2.0 ** exponent)


def exact_attention(q: torch.Tensor, k, v, mask: torch.Tensor | None, grid: Grid,
                    dtype: torch.dtype, *, heads_last: bool = False) -> torch.Tensor:
    """q [R, H, w, D], k [R, KV, S, D] on the grid of 2^-qk and v [R, KV, S, D] on the grid of
    2^-v, all float64 integers (`on_grid`; the runtime's RoPE lands q and k there), mask
    [R, 1, w, S] (or [w, S] for one row) additive float64 or None -> [R, H, w, D] in `dtype`.
    k and v may also come compact, as (int16 [R, KV, S, D], shift int8 [R, KV, S]) from the cache
    (`kernels.attn16.compress`): read in place by `kernels.attn16`, the same exact sums.

    Heads share their key head in groups of H / KV (grouped-query attention)."""
    R, H, w, D = q.shape
    kv = (k[0] if isinstance(k, tuple) else k).shape[1]
    qg = q.reshape(R, kv, (H // kv) * w, D)  # rows rounded for integer scores (`attn16.round_q`): exact
    s = attn16.scores(qg, *k) if isinstance(k, tuple) else torch.matmul(attn16.round_q(qg), k.transpose(-1, -2))
    s, den = attn16.weights(s, mask, w, grid.scale, grid.shift, 2.0 ** grid.v)  # P: integers up to 2^P_BITS
    pv = attn16.weighted(s, *v) if isinstance(v, tuple) else torch.matmul(s, v)  # P @ V: exact integers
    if heads_last and dtype == torch.bfloat16:  # [R, w, H x D]: what o_proj reads, in one C call
        return attn16.out(pv, den, w)
    return pv.div_(den).to(dtype).view(R, H, w, D)  # one division


def model_grids(model, head_dim: int, beta: float, orig_max: int, att_factor: float) -> list:
    """Per layer of `model`, the exact-attention grid (`grid_for`) from bounds on |q|, |k|, |v|:
    a projection's output is at most its largest row norm times the RMSNorm output's norm (at
    most the largest norm weight times sqrt(hidden)); RoPE keeps pair norms (times its attention
    factor, and q times the largest Llama-4 query scale); 25% margin for bf16 rounding."""
    cfg = model.config
    q_scale = 1 + beta * math.log(1 + cfg.max_position_embeddings // orig_max)
    rope = math.sqrt(2) * att_factor
    out = []
    for layer in model.encoder.layers:
        x = float(layer.input_layernorm.weight.detach().float().abs().max()) * math.sqrt(cfg.hidden_size) * 1.25
        at = layer.self_attn
        rows = [float(getattr(at, n).weight.detach().float().norm(dim=1).max()) * x for n in ("q_proj", "k_proj",
                                                                                                "v_proj")]
        out.append(grid_for(head_dim, rows[0] * rope * q_scale, rows[1] * rope, rows[2],
                            cfg.max_position_embeddings))
    qk, v = min(g.qk for g in out), min(g.v for g in out)  # one grid for every layer: the RoPE tables carry it
    return [replace(g, qk=qk, v=v, scale=head_dim ** -0.5 / 4.0 ** qk) for g in out]


def write_attend(cache, layer: int, rows: slice, starts: list[int], x: torch.Tensor, nq: int, mask, scale: float,
                 shift: float, vscale: float) -> torch.Tensor | None:
    """A compact cache's narrow round in one C call (`kernels.attn16.direct`): row r's new K and V
    (the key and value heads of x [R, q, nq + 2 kv, D], float64 grid integers) stored at slots
    starts[r].. of `cache` (a `cache.BatchKVCache`), and the layer's exact attention over slots
    0 .. max(starts) + q - 1 -> bf16 [R, q, nq D]; None, with nothing written, where that call does
    not run (then `BatchKVCache.write` and `exact_attention` do the same in steps)."""
    if not cache.block16:
        return None
    end = max(starts) + x.shape[1]
    if end > cache.capacity:
        raise RuntimeError(f"batch cache overflow: {end} slots needed, capacity {cache.capacity}")
    return attn16.direct(x, nq, starts, cache.k[layer], cache.shifts[2 * layer], cache.v[layer],
                         cache.shifts[2 * layer + 1], mask, scale, shift, vscale, row=rows.start or 0)


# -- RoPE: q and k rotated onto the attention's grid ----------------------------------------------
class Rope(NamedTuple):  # rows per position, sin signed for the rolled half, the query's times its scale
    q_cos: torch.Tensor
    q_sin: torch.Tensor
    k_cos: torch.Tensor
    k_sin: torch.Tensor


class RopeTables:
    """The forward's RoPE tables (`forward.FastForward.rope`), shared read-only by every generation
    on a model; growing them is the one write, done under a lock into new tensors swapped in
    whole, their length asked for as a Python int (a bound the caller knows), never read from a
    positions tensor. Per position 0 .. n - 1 (grown on demand, doubling), per device: cos and signed sin times
    YaRN's attention factor, the query's also times the Llama-4 query scale; in the exact formats
    float64 and times the attention grid's 2^qk, so RoPE lands q and k on the grid."""

    def __init__(self, inv_freq: torch.Tensor, att_factor: float, beta: float, orig_max: int, dtype: torch.dtype,
                 grids: list | None):
        self.inv_freq, self.att_factor, self.beta, self.orig_max = inv_freq, att_factor, beta, orig_max
        self.dtype, self.grids = dtype, grids
        self._lock = threading.Lock()
        self._tab = None  # (n, {device: Rope}), replaced as one object

    def _make(self, n: int) -> Rope:
        """rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi], and the Llama-4 query scale
        multiplies the rotated query, so it folds into the query's tables."""
        pos = torch.arange(n, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :].cpu()
        emb = torch.cat([freqs, freqs], -1)
        dtype = torch.float64 if self.grids is not None else self.dtype
        cos = (emb.cos() * self.att_factor).to(dtype)
        sin = (emb.sin() * self.att_factor).to(dtype)
        h = sin.shape[-1] // 2
        sin = torch.cat([-sin[:, :h], sin[:, h:]], -1)
        scale = (1 + self.beta * torch.log(1 + torch.floor(pos / self.orig_max))).to(dtype)[:, None]
        if self.grids is not None:  # q and k land on the grid of 2^-qk (`attention.Grid`): the tables carry it
            g = 2.0 ** self.grids[0].qk
            cos, sin = cos * g, sin * g
        return Rope(cos * scale, sin * scale, cos, sin)

    def full(self, need: int, device) -> Rope:
        """The tables for positions 0 .. at least need - 1, each [n, D], on `device`."""
        tab = self._tab
        if tab is None or tab[0] < need or device not in tab[1]:
            with self._lock:
                tab = self._tab
                if tab is None or tab[0] < need:
                    n = max(need, 2 * (0 if tab is None else tab[0]), 256)
                    tab = (n, {"base": self._make(n)})
                if device not in tab[1]:
                    tab = (tab[0], {**tab[1], device: Rope(*(t.to(device) for t in tab[1]["base"]))})
                self._tab = tab
        return tab[1][device]
