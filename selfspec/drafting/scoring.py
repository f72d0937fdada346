"""Prefix-aligned scoring for PRESTO: s = log q_d(t) + lambda * log rho(t | path).

Diffusion marginals q_d are blind to which tokens the tree placed before depth d; rho is a
prefix-conditioned estimate of how likely the target accepts t after that path. Every rho here
returns log-probabilities (<= 0), so path scores never increase along a path and the tree
builder's top set stays prefix-closed.

A token-level rho is a callable `(w2, w1, t, depth) -> log rho` over equal-shaped long tensors,
where (w2, w1) are the last two tokens before t on its path (context tokens when the path is
short); a feature-level rho (the learned predictor) reads the whole `tree.Expansion`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Expansion:
    """What a score term sees when the builder expands P frontier nodes by K candidates at depth d.

    All tensors are [P, K]: (w2, w1) the last two tokens before the candidate t on its path; lq
    and rank the candidate's log marginal and its rank at depth d (0 = top-1); parent_lq and
    parent_rank the same for the parent (0 and -1 for the root); entropy the marginal's entropy
    at depth d (None when the caller did not compute it). A per-tree table (`predictor`) uses
    the same type with a leading depth axis and per-depth depth/entropy tensors.
    """

    depth: int | torch.Tensor
    w2: torch.Tensor
    w1: torch.Tensor
    t: torch.Tensor
    lq: torch.Tensor
    rank: torch.Tensor
    parent_lq: torch.Tensor
    parent_rank: torch.Tensor
    entropy: float | torch.Tensor | None = None


ScoreFn = Callable[[Expansion], torch.Tensor]


def path_context(committed: list[int], path: list[int], n: int = 2) -> list[int]:
    """The `n` tokens before a candidate: the committed text's end, then the path's tokens.

    The one definition of a candidate's context used by the tree builder, the runtime and the
    predictor; -1 stands where the text is shorter than n.
    Example: path_context([5, 6, 7], [9], 3) == [6, 7, 9]; path_context([5], [], 2) == [-1, 5].
    """
    tail = (list(committed) + list(path))[-n:] if n else []
    return [-1] * (n - len(tail)) + tail


class NgramRho:
    """Interpolated 3-gram over a token context (prompt + generated), vectorised in torch.

    p1(t)       = (c(t) + 1) / (L + V)                       (add-one unigram)
    p2(t | b)   = (c(b, t) + p1(t)) / (c(b, .) + 1)          (Dirichlet backoff, weight 1)
    p3(t | a,b) = (c(a, b, t) + p2(t | b)) / (c(a, b, .) + 1)
    Counts come from sorted n-gram keys and `searchsorted`, so a lookup costs no Python loop.
    Optional `corpus` ids add fixed counts from a larger text.

    Example: context [5, 6, 7, 5, 6] -> p3(7 | 5, 6) = (1 + p2) / 2 >= 0.5; an unseen
    continuation gets only the smoothed backoff mass.
    """

    def __init__(self, vocab_size: int, context: torch.Tensor | list[int] | None = None):
        self.V = int(vocab_size)
        self.ctx = torch.as_tensor(context if context is not None else [], dtype=torch.long).reshape(-1)
        self._new: list[int] = []  # tokens appended since the counts were made
        self.uni = None  # the counts, made when first scored: rounds that build no tree pay nothing

    def extend(self, tokens: list[int] | torch.Tensor) -> None:
        if isinstance(tokens, torch.Tensor):  # a decoder's list (every round) skips the tensor round trip
            tokens = tokens.reshape(-1).tolist()
        self._new.extend(int(t) for t in tokens)

    def _index(self) -> None:
        if self._new:
            self.ctx = torch.cat([self.ctx, torch.tensor(self._new, dtype=torch.long)])
            self._new = []
        c, V = self.ctx, self.V
        # unigram and "as a history" counts are dense gathers; longer n-grams use sorted keys
        self.uni = torch.bincount(c, minlength=V).float()
        self.hist1 = torch.bincount(c[:-1], minlength=V).float() if c.numel() > 1 else torch.zeros(V)
        self.k2 = (c[:-1] * V + c[1:]).sort().values if c.numel() > 1 else c[:0]
        self.k3 = (c[:-2] * V * V + c[1:-1] * V + c[2:]).sort().values if c.numel() > 2 else c[:0]
        self.h2 = (c[:-2] * V + c[1:-1]).sort().values if c.numel() > 2 else c[:0]

    @staticmethod
    def _count(keys: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        if keys.numel() == 0:
            return torch.zeros(q.shape, dtype=torch.float32)
        q = q.contiguous()
        return (torch.searchsorted(keys, q, right=True) - torch.searchsorted(keys, q)).float()

    def __call__(self, w2: torch.Tensor, w1: torch.Tensor, t: torch.Tensor, depth: int = 0) -> torch.Tensor:
        if self._new or self.uni is None:
            self._index()
        V = self.V
        p1 = (self.uni[t] + 1) / (self.ctx.numel() + V)
        w1c, w2c = w1.clamp(min=0), w2.clamp(min=0)  # -1 = no such context token (very short prompts)
        p2 = (self._count(self.k2, w1c * V + t) + p1) / (self.hist1[w1c] + 1)
        h = w2c * V + w1c
        p3 = (self._count(self.k3, h * V + t) + p2) / (self._count(self.h2, h) + 1)
        if bool((w2 < 0).any()) or bool((w1 < 0).any()):
            p3 = torch.where((w2 >= 0) & (w1 >= 0), p3, torch.where(w1 >= 0, p2, p1))
        return p3.log()


def token_grid(top_tok: torch.Tensor, root: int, h2: int):
    """(w2, w1, t), each [D, K, K, K]: entry [d-1, i2, i1, j] is candidate j of depth d after the
    i1-th candidate of depth d-1 and the i2-th of depth d-2 (depth 0 is the root, depth -1 the
    context token before it; their rows repeat one token)."""
    D, K = top_tok.shape
    rows = torch.cat([torch.full((1, K), h2), torch.full((1, K), root), top_tok])  # depths -1, 0, 1..D
    w2 = rows[:D][:, :, None, None].expand(D, K, K, K)
    w1 = rows[1 : D + 1][:, None, :, None].expand(D, K, K, K)
    t = rows[2:][:, None, None, :].expand(D, K, K, K)
    return w2, w1, t


class TokenScore:
    """lambda * log rho for a token-level rho, as a `tree.ScoreFn`.

    Inside one tree, (w2, w1, t) at depth d ranges over at most K^3 combinations (candidates of
    depths d-2, d-1 and d), so `table` scores all of them for all depths in one vectorised call
    and the builder only gathers from it: no rho call per expansion step.
    """

    def __init__(self, rho, lam: float):
        self.rho, self.lam = rho, lam

    def __call__(self, x) -> torch.Tensor:
        return self.lam * self.rho(x.w2, x.w1, x.t, x.depth)

    def tokens(self, w2: torch.Tensor, w1: torch.Tensor, t: torch.Tensor, depth: int) -> torch.Tensor:
        """The term for arbitrary (w2, w1, t) triples (candidates outside the table's top-K)."""
        return self.lam * self.rho(w2, w1, t, depth)

    def table(self, top_lq, top_tok, root: int, h2: int, entropy=None) -> torch.Tensor:
        """[D, K, K, K] scores, indexed as in `token_grid`."""
        return self.lam * self.rho(*token_grid(top_tok, root, h2), 0)


class FeatureScore:
    """lambda * log rho for a rho that reads features (`log_rho(expansion)`, `log_rho_table(...)`)."""

    def __init__(self, rho, lam: float):
        self.rho, self.lam = rho, lam

    def __call__(self, x) -> torch.Tensor:
        return self.lam * self.rho.log_rho(x)

    def table(self, top_lq, top_tok, root: int, h2: int, entropy=None) -> torch.Tensor:
        return self.lam * self.rho.log_rho_table(top_lq, top_tok, root, h2, entropy)


def make_extra_score(rho, lam: float):
    """The term added to log q in the tree builder (a `tree.ScoreFn`), or None when it is zero.

    `rho` is either a token-level rho `(w2, w1, t, depth) -> log rho` (NgramRho) or a
    feature-level one with `log_rho` / `log_rho_table` (the learned predictor); both come back
    as score objects whose `table` the builder evaluates once per tree.
    """
    if lam == 0 or rho is None:  # rho 'none': the naive tree
        return None
    return FeatureScore(rho, lam) if hasattr(rho, "log_rho") else TokenScore(rho, lam)
