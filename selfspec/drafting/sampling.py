"""Sampling and target selection: pure functions with an explicit `torch.Generator`.

The verifier never compares probabilities: at each visited node it *draws* the target's token
(argmax at temperature 0) and accepts a draft token only if it equals that draw, so every
emitted token is an exact sample of the model in every mode.
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
           banned: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """One target token per row of `logits` [n, V]: argmax at T=0, else an independent sample."""
    x = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p, banned=banned)
    if temperature == 0:
        return x.argmax(-1)
    # inverse-CDF draw: the first token whose cumulative probability exceeds u ~ U[0, total).
    # Exactly the categorical distribution, and ~10x cheaper than torch.multinomial for one draw
    # per row (which dominated a CPU round's sampling time).
    cdf = x.softmax(-1).cumsum(-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=cdf.device, dtype=cdf.dtype)
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True).squeeze(-1)
    return idx.clamp_(max=cdf.shape[-1] - 1)
