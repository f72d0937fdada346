"""Sampling and target selection: pure functions over explicit randomness.

The verifier never compares probabilities: at each visited node it *draws* the target's token
(argmax at temperature 0) and accepts a draft token only if it equals that draw, so every
emitted token is an exact sample of the model in every mode.

Two sources of randomness:

* reproducible (the default): `PositionNoise`, Gumbel noise keyed by (key, output position).
  The token at output position t is argmax(filtered logits_t / T + g_t): a Gumbel-max draw,
  an exact sample of softmax(filtered logits_t / T) because g_t is independent of everything
  that decided the prefix. Every node of a tree at depth d stands for the same position, so it
  uses the same g_t; nothing a round does moves the noise of any position, so the same key gives
  the same tokens whatever the layout, the batch or the thread, and AR's tokens;
* independent: one draw per node from the row's `torch.Generator` (the order of draws follows
  the layouts, so a seed reproduces a run only with the same layouts).
"""

from __future__ import annotations

import torch

NEG = float("-inf")


def ban_token(logits: torch.Tensor, banned: int | None) -> torch.Tensor:
    """Float32 logits with `banned` (the mask id) at -inf: a token that is never produced nor drafted.

    A copy whenever it changes anything, so the caller's logits stay intact.
    """
    x = logits.float()
    if banned is not None:
        x = x.clone()
        x[..., banned] = NEG
    return x


def process_logits(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
                   banned: int | None = None) -> torch.Tensor:
    """Logits [..., V] -> filtered, temperature-scaled float32 logits (HF semantics).

    `banned` (the mask id) can never be produced. Temperature 0 returns the raw logits (argmax).
    """
    x = ban_token(logits, banned)
    if temperature == 0:
        return x
    x = x / temperature
    if top_k and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, NEG)
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum - sorted_x.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        drop[..., 0] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), NEG)
    return x


def select(logits: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0,
           banned: int | None = None, generator: torch.Generator | None = None,
           noise: torch.Tensor | None = None) -> torch.Tensor:
    """One target token per row of `logits` [n, V]: argmax at T=0; else with `noise` [n, V] (each
    row's position's Gumbel noise) the Gumbel-max draw, else an independent sample."""
    x = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, banned=banned)
    if temperature == 0:
        return x.argmax(-1)
    if noise is not None:
        return (x.double() + noise.to(x.device)).argmax(-1)
    # inverse-CDF draw: the first token whose cumulative probability exceeds u ~ U[0, total).
    # Exactly the categorical distribution, and ~10x cheaper than torch.multinomial for one draw
    # per row (which dominated a CPU round's sampling time).
    cdf = x.softmax(-1).cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=cdf.device, dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
    return idx.clamp_(max=cdf.shape[-1] - 1)


MASK64 = (1 << 64) - 1


def mix(*words: int) -> int:
    """A 63-bit key from integers (splitmix64 finalizer over their running combination)."""
    h = 0x9E3779B97F4A7C15
    for w in words:
        h = (h ^ (w & MASK64)) * 0xBF58476D1CE4E5B9 & MASK64
        h = (h ^ (h >> 31)) * 0x94D049BB133111EB & MASK64
        h ^= h >> 29
    return h >> 1


class PositionNoise:
    """Gumbel noise per output position, from a key: g_t = -log(-log(u)) with u uniform in (0, 1)
    drawn by a generator seeded with mix(key, t, purpose). Position t's noise depends on nothing
    but (key, t): draw order, layouts, batches and threads cannot move it. Positions are cached
    until `forget_before` drops them.

    Example: PositionNoise(5, 8).at([3, 3, 4]) gives rows 0 and 1 equal (one position) and row 2
    another; PositionNoise(5, 8).at([4]) equals that row 2 in a fresh object."""

    TARGET = 1  # purpose of the noise the target draws use (more purposes may come)

    def __init__(self, key: int, vocab: int):
        self.key, self.vocab, self._cache = int(key), int(vocab), {}

    def at(self, positions: list[int]) -> torch.Tensor:
        """[len(positions), V] float64 noise."""
        rows = []
        for t in positions:
            g = self._cache.get(t)
            if g is None:
                gen = torch.Generator().manual_seed(mix(self.key, t, self.TARGET))
                u = torch.rand(self.vocab, generator=gen, dtype=torch.float64)
                g = self._cache[t] = u.log_().neg_().log_().neg_()  # -log(-log(u)), in place: the same bits
            rows.append(g)
        return torch.stack(rows)

    def forget_before(self, position: int) -> None:
        for t in [t for t in self._cache if t < position]:
            del self._cache[t]
