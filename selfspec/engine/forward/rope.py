"""RoPE tables of the compact forward (`forward.FastForward.rope`), per position and device.

Shared read-only by every generation on a model; growing them is the one write, done under a lock
into new tensors that are swapped in whole. Their length is asked for as a Python int (a position
bound the caller knows), never read from a positions tensor.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch


class Rope(NamedTuple):  # rows per position, sin signed for the rolled half, the query's times its scale
    q_cos: torch.Tensor
    q_sin: torch.Tensor
    k_cos: torch.Tensor
    k_sin: torch.Tensor


class RopeTables:
    """Per position 0 .. n - 1 (grown on demand, doubling), per device: cos and signed sin times
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
