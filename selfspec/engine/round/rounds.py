"""One verification round as one object, and the observers that read each row's part when it ends.

`step.step` runs a round as steps (plan, draft, lay out, forward, verify + commit, observe) that
fill one `Round`: the batch's option, hidden states and widths, and one `RowRound` per row. When a
row's tokens are emitted, every observer in that row's list receives its `RowRound` (and the `Round`): the stats,
the predictor's recorder and the round hook (`on_round`, whose dict contract, in
`decoder.Decoder`'s docstring, `RowRound.info` keeps); the planner observes the whole `Round` and
keeps a `Seen` of it until it settles its times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from selfspec.drafting.tree import Marginals, Tree
from selfspec.engine.round.layouts import Option


@dataclass
class RowRound:
    """One row's part of a round. Filled in step order; fields of later steps are None until then."""

    seq: object  # sequence.Sequence
    slot: int  # the cache row
    index: int  # 0-based verification round of this sequence
    cache_len: int  # KV-cache length (accepted prefix) before the round
    root: int  # the last emitted token, not yet in the cache
    marg: Marginals | None  # marginals at hand when the round began (one-pass), or None
    room: int  # tokens the sequence may still emit
    emitted_before: int
    forward_before: float = 0.0  # the sequence's stats.forward_seconds when the round began
    query_before: int = 0
    # plan
    forecast: object = None  # planner.Forecast of what this row could draft
    big: Tree | None = None  # the planner's largest tree (a tree option takes its top-N subtree)
    drafted: list[int] | None = None  # lookup drafts, when the planner read them
    chain_key: tuple = (1, 0)  # plan "auto": the lookup calibration's key of those drafts (`Planner.forecast`)
    # draft
    drafted_from: Marginals | None = None  # the marginals the tree came from
    tree: Tree | None = None
    history: tuple | None = None  # the two tokens before the root (the recorder's context)
    # lay out + forward
    owners: torch.Tensor | None = None  # tree nodes that own a mask group (one-pass)
    logits: torch.Tensor | None = None  # [nodes + 1, V]
    targets: torch.Tensor | None = None
    # verify + commit
    path: list[int] | None = None
    bonus: int = -1
    next_marg: Marginals | None = None
    committed: list[int] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the round
    forward_seconds: float = 0.0
    query_tokens: int = 0

    @property
    def nodes(self) -> int:
        """Draft nodes under the root of the tree this row verified (0: AR)."""
        return len(self.tree) - 1

    def info(self, layout: str, lam: float, top_k: int) -> dict:
        """The round hook's dict (the contract in `decoder.Decoder`'s docstring)."""
        m = self.drafted_from
        return {"round": self.index, "row": self.seq.index, "c": self.cache_len, "tree": self.tree,
                "cands": None if m is None else (m.top_lq, m.top_tok, m.entropy),
                "targets": self.targets, "path": self.path, "bonus": self.bonus, "committed": self.committed,
                "layout": layout, "forward_seconds": self.forward_seconds, "query_tokens": self.query_tokens,
                "lam": lam,
                "oracle_candidates": torch.zeros(0, 1, dtype=torch.long) if m is None else m.top_tok[:, :top_k]}


@dataclass
class Round:
    """A round of the whole batch: the option every row runs, the forward's widths and hidden
    states, and the rows. `draining`: no request waits for a cache row (the batch ends with its
    slowest row)."""

    rows: list[RowRound]
    draining: bool = False
    t_start: float = field(default_factory=time.perf_counter)
    option: object = None  # layouts.Option
    layout: str = ""
    hidden: torch.Tensor | None = None  # [rows, width, H] of the verification forward
    nodes_width: int = 0  # the widest tree (every row's mask groups start at this column)
    width: int = 0  # query tokens per row of the verification forward (padding included)
    model_seconds: float = 0.0  # the round's model time (every forward, both passes)
    plan_seconds: float = 0.0  # the planner's time (forecasts: charged to speculation)
    target_seconds: float = 0.0  # the target's tokens drawn for every verified node (sampled ones are dear on a CPU)
    target_rows: int = 0  # how many (each row's tree nodes and root)
    seconds: float = 0.0
    bare: bool = False  # plan "auto": an AR round the planner forecast nothing for (its floor's reference)
    refresh: bool = False  # a bare round run to measure AR's time again while the planner bets (`planner.REFRESH_AR`)
    join_tokens: int = 0  # query tokens of a joining prompt's chunk that ran in this round's forward
    joined: tuple = (0, [])  # (n, first chunks) of the sequences whose prompts that chunk completed

    @property
    def cache_len(self) -> int:
        """The longest row's cache length: what the round's attention spans."""
        return max(r.cache_len for r in self.rows)


class Seen(NamedTuple):
    """What the planner keeps of a finished `Round` until it settles it (`planner.Planner.settle`)."""

    option: Option
    rows: int
    width: int  # query tokens per row (padding included)
    cache_len: int
    model_seconds: float
    seconds: float
    plan_seconds: float
    bare: bool
    draining: bool
    value: float  # committed tokens as the batch values them (`choice.round_value`)
    marginals: bool = False  # a probe, or a round with marginals at hand: the probe's bet (`close_episode`)
    target_seconds: float = 0.0  # drawing the target's tokens (`Round.target_seconds`)
    target_rows: int = 0
    refresh: bool = False  # `Round.refresh`: AR's time after a streak of bets (`round_costs.REFRESH_EMA`)


def stats_observer(stats):
    """Counts a row's round into its `Stats` (rounds, layouts, accepted lengths)."""

    def observe(r: RowRound, rnd: Round) -> None:
        stats.rounds += 1
        stats.plan_hist[rnd.layout] += 1
        stats.accept_lengths.append(len(r.committed))
        stats.round_tokens += len(r.committed)

    return observe


def recorder_observer(recorder, top_k: int, rho):
    """The predictor's recorder (`training.predictor`): every round that verified a tree drafted
    from marginals, with the candidates, targets, entropy, context, n-gram rho and target logits."""

    def observe(r: RowRound, rnd: Round) -> None:
        m = r.drafted_from
        if m is not None and r.nodes > 0:
            recorder(r.tree, m.top_lq[:, :top_k], m.top_tok[:, :top_k], r.targets, m.entropy, r.history, rho, r.logits)

    return observe
