"""Round layouts as values: `Option` (what one round runs) and the one spelling of every layout's
name, for rounds, fixed settings and the benchmark's rows."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class Option:
    """One round's layout: N draft nodes, m groups of G masks, with or without a draft pass."""

    nodes: int
    groups: int = 0
    group_size: int = 0
    draft_pass: bool = False
    source: str = "tree"  # "tree" (marginals, with context candidates) or "lookup" (a context chain)

    @property
    def query_tokens(self) -> int:
        return self.nodes + 1 + self.groups * self.group_size

    @property
    def label(self) -> str:
        return _label(self)

    def _label(self) -> str:
        if self.source == "lookup":
            return layout_label("lookup", nodes=self.nodes)
        if self.draft_pass:
            return layout_label(schedule="two-pass", nodes=self.nodes)
        if self.groups:
            return layout_label(schedule="one-pass", nodes=self.nodes, groups=self.groups, group_size=self.group_size)
        return "ar" if self.nodes == 0 else layout_label("verify", nodes=self.nodes)


AR = Option(0)


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
    "linear/two-pass", "presto/one-pass/N=32", "presto/one-pass/N=32/lookup" (context candidates)."""
    if cfg.mode in ("ar", "auto", "lookup"):
        return cfg.mode
    presto = cfg.mode == "presto"
    return layout_label(cfg.mode, schedule=cfg.schedule, nodes=cfg.budget if presto else None,
                        lookup=presto and bool(cfg.lookup))


def fixed_option(cfg) -> Option:
    """The layout a fixed mode uses every round."""
    if cfg.mode == "ar":
        return Option(0)
    if cfg.mode == "lookup":
        return Option(cfg.lookup_tokens, source="lookup")
    n = cfg.budget if cfg.mode == "presto" else cfg.block_length - 1
    if cfg.schedule == "two-pass":
        return Option(n, draft_pass=True)
    return Option(n, n + 1 if cfg.group_nodes is None else cfg.group_nodes, cfg.group)


@lru_cache(maxsize=4096)
def _label(o: Option) -> str:
    return o._label()
