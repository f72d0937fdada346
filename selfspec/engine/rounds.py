"""One verification round as one object, and the observers that read it when it ends.

`batch.BatchDecoder` runs a round as steps (plan, draft, lay out + forward, verify, commit) that
fill one `Round` per row; when a row's tokens are emitted, every observer in that row's list
receives its round: the stats, the batch-1 planner's calibration (`planner.Planner.observe`),
the predictor's recorder and the round hook (`on_round`, whose dict contract, in
`decoder.Decoder`'s docstring, `Round.info` keeps; the decoder adds the row).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from selfspec.drafting.tree import Marginals, Tree


@dataclass
class Round:
    """A round's state. Filled in step order; fields of later steps are None until then."""

    index: int  # 0-based verification round
    c: int  # KV-cache length (accepted prefix) before the round
    root: int  # the last emitted token, not yet in the cache
    marg: Marginals | None  # marginals at hand when the round began (one-pass), or None
    room: int  # tokens the generation may still emit
    emitted_before: int  # tokens emitted before the round
    t_start: float = field(default_factory=time.perf_counter)
    forward_before: float = 0.0  # stats.forward_seconds when the round began
    query_before: int = 0
    # plan
    option: object = None  # layouts.Option
    layout: str = ""
    big: Tree | None = None  # the planner's largest tree (its pick is a top-N subtree)
    drafted: list[int] | None = None  # lookup drafts, when the planner read them
    match: int = 1  # n-gram length behind the lookup drafts
    # draft
    drafted_from: Marginals | None = None  # the marginals the tree came from
    tree: Tree | None = None
    history: tuple | None = None  # the two tokens before the root (the recorder's context)
    # lay out + forward
    owners: torch.Tensor | None = None
    group_size: int = 0
    logits: torch.Tensor | None = None
    # verify
    targets: torch.Tensor | None = None
    path: list[int] | None = None
    bonus: int = -1
    # commit
    next_marg: Marginals | None = None
    committed: list[int] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the round
    forward_seconds: float = 0.0
    query_tokens: int = 0

    @property
    def n(self) -> int:
        return len(self.tree)

    def info(self, lam: float, top_k: int) -> dict:
        """The round hook's dict (the contract in `decoder.Decoder`'s docstring)."""
        m = self.drafted_from
        return {"round": self.index, "c": self.c, "tree": self.tree,
                "cands": None if m is None else (m.top_lq, m.top_tok, m.entropy),
                "targets": self.targets, "path": self.path, "bonus": self.bonus, "committed": self.committed,
                "layout": self.layout, "forward_seconds": self.forward_seconds, "query_tokens": self.query_tokens,
                "lam": lam,
                "oracle_candidates": torch.zeros(0, 1, dtype=torch.long) if m is None else m.top_tok[:, :top_k]}


def stats_observer(stats):
    """Counts a round into `Stats` (rounds, layouts, accepted lengths)."""

    def observe(r: Round) -> None:
        stats.rounds += 1
        stats.plan_hist[r.layout] += 1
        stats.accept_lengths.append(len(r.committed))
        stats.round_tokens += len(r.committed)

    return observe


def recorder_observer(recorder, k: int, rho):
    """The predictor's recorder (`training.predictor`): every round that verified a tree drafted
    from marginals, with the candidates, targets, entropy, context, n-gram rho and target logits."""

    def observe(r: Round) -> None:
        m = r.drafted_from
        if m is not None and r.n > 1:
            recorder(r.tree, m.top_lq[:, :k], m.top_tok[:, :k], r.targets, m.entropy, r.history, rho, r.logits)

    return observe
