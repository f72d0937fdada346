"""Decoding options: a frozen dataclass validated at construction, so bad input fails before any
model work. HF names where HF has one."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MODES = ("auto", "ar", "linear", "presto", "lookup")
PLANS = ("auto", "fixed")
SCHEDULES = ("two-pass", "one-pass")
RHOS = ("none", "ngram", "learned")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How to decode. Validated at construction; HF names where HF has one."""

    # plan "auto" (default): the layout of every round is chosen from the device's cost profile
    # (selfspec.engine.planner); naming a mode fixes the layout ("fixed" alone means PRESTO one-pass)
    mode: str | None = None
    plan: str | None = None
    schedule: str = "one-pass"
    block_length: int = 16
    group_size: int | None = None  # one-pass mask-group size; None = block_length
    group_nodes: int | None = None  # one-pass: tree nodes that get a group; None = every node
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # sampling top-k (0 = off)
    top_p: float = 1.0
    budget: int = 32  # PRESTO draft nodes under the root (the root is not counted: the tree has budget + 1 nodes)
    tree_top_k: int = 4  # PRESTO candidates per depth
    lam: float = 0.2
    rho: str = "ngram"
    draft_lora: bool = True  # use the checkpoint's linear_spec_lora adapter (if any) on draft rows
    # context lookup: mode "lookup" drafts a chain copied from the context (prompt lookup);
    # `lookup` adds each path's context continuations to PRESTO's candidates (None: on for auto)
    lookup: bool | None = None
    lookup_min_ngram: int = 1
    lookup_max_ngram: int = 3
    lookup_tokens: int = 10

    def __post_init__(self):
        for f in fields(self):  # every float option, present and future: NaN / inf would poison scores or sampling
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v}")
        if self.plan is not None and self.plan not in PLANS:
            raise ValueError(f"unknown plan {self.plan!r}; expected one of {PLANS}")
        if self.mode is None:
            object.__setattr__(self, "mode", "presto" if self.plan == "fixed" else "auto")
        if self.plan == "auto" and self.mode != "auto":
            raise ValueError(f"plan 'auto' chooses the layout itself; drop mode={self.mode!r} or use plan='fixed'")
        object.__setattr__(self, "plan", "auto" if self.mode == "auto" else "fixed")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.lookup is None:  # context candidates need a token-level rho: off with the learned one
            object.__setattr__(self, "lookup", self.mode == "auto" and self.rho != "learned")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError(f"need 1 <= lookup_min_ngram <= lookup_max_ngram; got lookup_min_ngram="
                             f"{self.lookup_min_ngram}, lookup_max_ngram={self.lookup_max_ngram}")
        if self.lookup_tokens < 1:
            raise ValueError(f"lookup_tokens must be >= 1, got {self.lookup_tokens}")
        if self.lookup and self.rho == "learned" and self.mode in ("presto", "auto"):
            raise ValueError("lookup candidates are scored with a token-level rho; use rho 'ngram' or 'none' with lookup, "
                             "or lookup=False with rho 'learned'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")
        if self.block_length < 2:
            raise ValueError(f"block_length must be >= 2, got {self.block_length}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.group_nodes is not None and self.group_nodes < 1:
            raise ValueError(f"group_nodes must be >= 1, got {self.group_nodes}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.tree_top_k < 1:
            raise ValueError(f"tree_top_k (tree candidates per depth) must be >= 1, got {self.tree_top_k}")
        if self.lam < 0:
            raise ValueError(f"lam (PRESTO lambda) must be >= 0, got {self.lam}")
        if self.rho not in RHOS:
            raise ValueError(f"unknown rho {self.rho!r}; expected one of {RHOS}")

    @property
    def group(self) -> int:
        return self.group_size if self.group_size is not None else self.block_length

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
