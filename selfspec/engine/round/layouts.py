"""Round layouts as values: `Option` (exactly what one round runs, for every row of the batch) and
the one spelling of every layout's name, for rounds, fixed settings and the benchmark's rows."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
