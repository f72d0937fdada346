"""A round: its layout as a value (`Option`: exactly what one round runs, for every row of the batch,
and the one spelling of every layout's name), and the round as one object with the observers that
read each row's part when it ends.

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
from functools import lru_cache
from typing import NamedTuple

import torch

from selfspec.drafting.tree import Marginals, Tree


# -- layouts: what one round runs --------------------------------------------------------------------
DRAFTS = ("none", "tree", "chain", "lookup")


@dataclass(frozen=True)
class Option:
    """One round's layout, the same for every row of the batch.

    `draft`: where each row's draft nodes come from: "none" (AR; with groups, a probe that only
    buys marginals), "tree" (PRESTO's top-`nodes` tree from the row's marginals), "chain" (the
    marginals' top-1 chain: the linear draft) or "lookup" (a chain copied from the context).
    `nodes`: draft nodes under the root per row (the root is not counted: a row's tree has up to
    nodes + 1); `groups` mask groups of `group_size` slots per row (one-pass: the next round's
    marginals); `draft_pass`: a draft pass [root, masks] first (two-pass); `pad_to`: the width
    the forward is padded to when the device runs that width cheaper (0: no padding).

    Examples: AR is Option(); a lookup chain of 4 is Option("lookup", 4); PRESTO one-pass with
    budget 8 and a group of 16 on every node is Option("tree", 8, 9, 16).
    """

    draft: str = "none"
    nodes: int = 0
    groups: int = 0
    group_size: int = 0
    draft_pass: bool = False
    pad_to: int = 0

    def __post_init__(self):
        if self.draft not in DRAFTS:
            raise ValueError(f"unknown draft {self.draft!r}; expected one of {DRAFTS}")
        if min(self.nodes, self.groups, self.group_size, self.pad_to) < 0:
            raise ValueError(f"negative sizes in {self!r}")
        if (self.draft == "none") != (self.nodes == 0):
            raise ValueError(f"draft {self.draft!r} with {self.nodes} nodes")

    @property
    def width(self) -> int:
        """Query tokens per row of the round's (verification) forward."""
        return max(self.pad_to, self.nodes + 1 + self.groups * self.group_size)

    @property
    def speculative(self) -> bool:
        return self.nodes > 0 or self.groups > 0 or self.draft_pass

    @property
    def family(self) -> str:
        """The kind of round, for per-kind timing: "ar", "lookup", "two-pass", "one-pass", "verify"."""
        return _family(self)

    @property
    def label(self) -> str:
        return _label(self)

    def _label(self) -> str:
        if self.draft == "lookup":
            return layout_label("lookup", nodes=self.nodes)
        name = "linear" if self.draft == "chain" else None
        if self.draft_pass:
            return layout_label(name, schedule="two-pass", nodes=self.nodes)
        if self.groups:
            return layout_label(name, schedule="one-pass", nodes=self.nodes, groups=self.groups,
                                group_size=self.group_size)
        return "ar" if self.nodes == 0 else layout_label(name or "verify", nodes=self.nodes)


AR = Option()


def layout_label(name: str | None = None, *, schedule: str | None = None, nodes: int | None = None,
                 groups: int = 0, group_size: int = 0, lookup: bool = False) -> str:
    """The one spelling of a layout, for a round (`Option.label`), a fixed setting (`config_label`)
    and the benchmark's rows: the parts that apply, joined by "/".

    Examples: layout_label("presto", schedule="one-pass", nodes=32) == "presto/one-pass/N=32";
    layout_label(schedule="one-pass", nodes=8, groups=9, group_size=8) == "one-pass/N=8/m=9/G=8".
    """
    parts = [p for p in (name, schedule) if p]
    if nodes is not None:
        parts.append(f"N={nodes}")
    if groups:
        parts += [f"m={groups}", f"G={group_size}"]
    if lookup:
        parts.append("lookup")
    return "/".join(parts)


def config_label(cfg) -> str:
    """A `DecodeConfig`'s layout: "ar", "lookup", "auto" (its rounds have their own labels),
    "linear/two-pass", "presto/one-pass/N=32", "presto/one-pass/N=32/lookup" (context candidates),
    "presto/auto/N=32" (PRESTO laid out per round by the planner)."""
    if cfg.mode in ("ar", "auto", "lookup"):
        return cfg.mode
    presto = cfg.mode == "presto"
    return layout_label(cfg.mode, schedule=cfg.schedule or "auto", nodes=cfg.budget if presto else None,
                        lookup=presto and bool(cfg.lookup))


def fixed_option(cfg) -> Option:
    """The layout a fixed mode runs every round."""
    if cfg.mode == "ar":
        return AR
    if cfg.mode == "lookup":
        return Option("lookup", cfg.lookup_tokens)
    draft = "tree" if cfg.mode == "presto" else "chain"
    nodes = cfg.budget if cfg.mode == "presto" else cfg.block_length - 1
    if cfg.schedule == "two-pass":
        return Option(draft, nodes, draft_pass=True)
    return Option(draft, nodes, nodes + 1 if cfg.group_nodes is None else cfg.group_nodes, cfg.group)


@lru_cache(maxsize=4096)
def _label(o: Option) -> str:
    return o._label()


@lru_cache(maxsize=4096)
def _family(o: Option) -> str:  # asked several times a round by the planner
    return _label(o).split("/")[0]


# -- the round: what it ran and committed, row by row ---------------------------------------------------
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
