"""RoPE tables of the compact forward: per position, cos and signed sin times YaRN's attention factor,
the query's also times the Llama-4 query scale; for the exact formats in float64 on the attention
grid, with v's grid scale beside them so one rotation puts q, k and v on their grids.

Shared read-only by every generation on a model (`FastForward.rope`); growing them is the one
write, done under a lock into new tensors that are swapped in whole.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch


class Rope(NamedTuple):
    """RoPE tables: rows per position, sin signed for the rolled half, the query's times its scale."""

    q_cos: torch.Tensor
    q_sin: torch.Tensor
    k_cos: torch.Tensor
    k_sin: torch.Tensor


class RopeTables:
    """The tables for positions 0 .. n - 1 (grown on demand, doubling), per device."""

    def __init__(self, inv_freq: torch.Tensor, att_factor: float, beta: float, orig_max: int, n_heads: int,
                 n_kv: int, head_dim: int, dtype: torch.dtype, grids: list | None):
        self.inv_freq, self.att_factor, self.beta, self.orig_max = inv_freq, att_factor, beta, orig_max
        self.n_heads, self.n_kv, self.head_dim, self.dtype, self.grids = n_heads, n_kv, head_dim, dtype, grids
        self.exact = grids is not None
        self._lock = threading.Lock()
        self._tab = None  # (n, {device: Rope}), replaced as one object

    def _make(self, n: int) -> Rope:
        """Per position 0..n-1: the RoPE tables, with the sin signed and the query tables times
        the query scale.

        rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi], and the Llama-4 query scale
        multiplies the rotated query, so it folds into the query's tables.
        """
        pos = torch.arange(n, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :].cpu()
        emb = torch.cat([freqs, freqs], -1)
        dtype = torch.float64 if self.exact else self.dtype
        cos = (emb.cos() * self.att_factor).to(dtype)
        sin = (emb.sin() * self.att_factor).to(dtype)
        h = sin.shape[-1] // 2
        sin = torch.cat([-sin[:, :h], sin[:, h:]], -1)
        scale = (1 + self.beta * torch.log(1 + torch.floor(pos / self.orig_max))).to(dtype)[:, None]
        if self.exact:  # q and k land on the grid of 2^-qk (`attention.Grid`): the tables carry it
            g = 2.0 ** self.grids[0].qk
            cos, sin, scale = cos * g, sin * g, scale
        return Rope(cos * scale, sin * scale, cos, sin)

    def rows(self, positions: torch.Tensor, device) -> Rope:
        """The tables' rows for `positions` (flat), each [n, D], on `device`."""
        p = positions.reshape(-1).to(device)
        return Rope(*(t[p] for t in self.full(int(positions.max()) + 1, device)))

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

    def tables(self, positions: torch.Tensor, device) -> tuple:
        """RoPE for query columns at `positions` [R, q]. Plain: a `Rope` broadcastable to
        [R, heads, q, D]. Exact formats: (cos, sin) [R, q, heads + 2 * kv_heads, D] in float64 over
        the fused q / k / v output, q and k rotated onto the attention grid, v scaled onto its own
        grid (cos 2^v, sin 0), so one rotation puts all three on their grids (`FastForward._rotate`)."""
        R, q = positions.shape
        t = self.rows(positions, device)
        if not self.exact:
            return Rope(*(x.view(R, q, self.head_dim)[:, None] for x in t))
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        v = torch.full((R * q, nkv, D), 2.0 ** self.grids[0].v, dtype=torch.float64, device=device)
        cos = torch.cat([t.q_cos[:, None].expand(-1, nh, D), t.k_cos[:, None].expand(-1, nkv, D), v], 1)
        sin = torch.cat([t.q_sin[:, None].expand(-1, nh, D), t.k_sin[:, None].expand(-1, nkv, D), v * 0], 1)
        return cos.view(R, q, nh + 2 * nkv, D), sin.view(R, q, nh + 2 * nkv, D)
