"""Decoding options: a frozen dataclass validated at construction, so bad input fails before any
model work. HF names where HF has one.

Types are checked at the boundary, from the annotations (`check_type`): a field annotated `bool`
takes only True / False (never "off"), `int` an integer that is not a bool, `float` any real
number but a bool, `X | None` also None. The same check serves the keyword arguments of the
public entry points that are not options (`check_args`).
"""

from __future__ import annotations

import difflib
import math
import numbers
import types
import typing
from dataclasses import dataclass, fields
from functools import lru_cache

MODES = ("auto", "ar", "linear", "presto", "lookup")
SAMPLINGS = ("reproducible", "independent")
PLANS = ("auto", "fixed")
SCHEDULES = ("two-pass", "one-pass")
RHOS = ("none", "ngram", "learned")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How to decode. Validated at construction; HF names where HF has one."""

    # plan "auto" (default): the layout of every round is chosen from the device's cost model
    # (selfspec.engine.planning.planner); naming a mode fixes the layout ("fixed" alone means PRESTO one-pass),
    # except mode "presto" with no schedule and no group_nodes: its trees are then laid out each
    # round as this device affords (the planner over PRESTO layouts and AR); naming a schedule,
    # group_nodes or plan "fixed" runs exactly that layout (the paper's: one-pass, a group per node)
    mode: str | None = None
    plan: str | None = None
    schedule: str | None = None  # None: chosen per round (plan "auto"); a fixed linear / PRESTO: one-pass
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
    # `lookup` adds each path's context continuations to PRESTO's candidates (None: on for plan
    # "auto" unless rho is "learned", off for a fixed mode); plan "auto" also drafts lookup chains
    lookup: bool | None = None
    lookup_min_ngram: int = 1
    lookup_max_ngram: int = 3
    lookup_tokens: int = 10
    # randomness at temperature > 0: "reproducible" (Gumbel noise keyed by the seed and the output
    # position, drafts coupled to it: the same seed gives the same tokens in every layout, batch
    # and thread) or "independent" (one draw per tree node from the row's generator)
    sampling: str = "reproducible"

    def __post_init__(self):
        hints = _hints(DecodeConfig)
        for f in fields(self):  # every option, present and future, is typed by its annotation
            v = check_type(f.name, getattr(self, f.name), hints[f.name])
            if v is not getattr(self, f.name):
                object.__setattr__(self, f.name, v)
            if isinstance(v, float) and not math.isfinite(v):  # NaN / inf would poison scores or sampling
                raise ValueError(f"{f.name} must be a finite number, got {v}")
        if self.plan is not None and self.plan not in PLANS:
            raise ValueError(f"unknown plan {self.plan!r}; expected one of {PLANS}")
        if self.mode is None:
            object.__setattr__(self, "mode", "presto" if self.plan == "fixed" else "auto")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.plan == "auto" and self.mode not in ("auto", "presto"):
            raise ValueError(f"plan 'auto' chooses the layout itself; drop mode={self.mode!r} or use plan='fixed'")
        laid_out = self.schedule is not None or self.group_nodes is not None
        if self.plan == "auto" and self.mode == "presto" and laid_out:
            raise ValueError("plan 'auto' chooses PRESTO's schedule and groups per round; drop schedule / group_nodes "
                             "or use plan='fixed'")
        planned = self.mode == "auto" or (self.mode == "presto" and self.plan != "fixed" and not laid_out)
        object.__setattr__(self, "plan", "auto" if planned else "fixed")
        if not planned and self.mode in ("linear", "presto") and self.schedule is None:
            object.__setattr__(self, "schedule", "one-pass")
        if self.lookup is None:  # context candidates need a token-level rho: off with the learned one
            object.__setattr__(self, "lookup", self.mode == "auto" and self.rho != "learned")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError(f"need 1 <= lookup_min_ngram <= lookup_max_ngram; got lookup_min_ngram="
                             f"{self.lookup_min_ngram}, lookup_max_ngram={self.lookup_max_ngram}")
        if self.lookup and self.rho == "learned" and self.mode in ("presto", "auto"):
            raise ValueError("lookup candidates are scored with a token-level rho; use rho 'ngram' or 'none' with lookup, "
                             "or lookup=False with rho 'learned'")
        if self.schedule is not None and self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")
        at_least(self, block_length=2, group_size=1, group_nodes=1, budget=1, tree_top_k=1, lookup_tokens=1, lam=0)
        check_sampling(self)
        if self.rho not in RHOS:
            raise ValueError(f"unknown rho {self.rho!r}; expected one of {RHOS}")
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"unknown sampling {self.sampling!r}; expected one of {SAMPLINGS}")

    @classmethod
    def from_options(cls, options: dict) -> "DecodeConfig":
        """`DecodeConfig(**options)`, with a ValueError naming any unknown option (and the closest
        known one) instead of Python's TypeError about an unexpected keyword."""
        known = [f.name for f in fields(cls)]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else "the options are " + ", ".join(known)
                raise ValueError(f"unknown decoding option {name!r} ({hint})")
        return cls(**options)

    @property
    def group(self) -> int:
        return self.group_size if self.group_size is not None else self.block_length


NAMES = {"tree_top_k": "tree_top_k (tree candidates per depth)", "lam": "lam (PRESTO lambda)"}


def at_least(obj, **lows) -> None:
    """Each named field of `obj` (unless None) at least its bound: one ValueError naming the first one below."""
    for name, low in lows.items():
        v = getattr(obj, name)
        if v is not None and v < low:
            raise ValueError(f"{NAMES.get(name, name)} must be >= {low}, got {v}")


def check_sampling(p) -> None:
    """The sampling fields of a `DecodeConfig` or a `sequence.SamplingParams`, typed and in range."""
    for name, kind in (("max_new_tokens", int), ("temperature", float), ("top_k", int), ("top_p", float)):
        v = check_type(name, getattr(p, name), kind)
        if v is not getattr(p, name):
            object.__setattr__(p, name, v)
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v}")
    at_least(p, max_new_tokens=1, temperature=0, top_k=0)
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")


# -- types at the boundary ------------------------------------------------------------------------

@lru_cache(maxsize=None)
def _hints(obj) -> dict:
    return typing.get_type_hints(obj)


def check_args(fn, **values):
    """Each keyword value checked against `fn`'s annotation of that parameter (see `check_type`)."""
    hints = _hints(fn)
    return {name: check_type(name, v, hints[name]) for name, v in values.items()}


def check_type(name: str, value, annotation):
    """`value` if it fits `annotation`, as the builtin type (an int for a numpy integer, a float for
    an int given as a float); else a TypeError naming the option, the expected type and the value.

    Understood: bool, int, float, str, None, list[X] (a list or tuple of X), classes, and unions of
    these. Example: check_type("budget", "32", int) raises "budget must be an int, got '32' (str)".
    """
    ok, v = _fit(value, annotation)
    if not ok:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise TypeError(f"{name} must be {_describe(annotation)}, got {shown} ({type(value).__name__})")
    return v


def _fit(value, ann) -> tuple[bool, object]:
    if typing.get_origin(ann) in (types.UnionType, typing.Union):
        for a in typing.get_args(ann):
            ok, v = _fit(value, a)
            if ok:
                return True, v
        return False, None
    if ann is None or ann is type(None):
        return value is None, value
    if ann is bool:  # a string such as "off" is truthy: it must never pass as a flag
        return isinstance(value, bool), value
    if ann is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return ok, (value if type(value) is int else int(value)) if ok else None
    if ann is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return ok, (value if type(value) is float else float(value)) if ok else None
    if typing.get_origin(ann) is list:
        (item,) = typing.get_args(ann)
        if not isinstance(value, (list, tuple)):
            return False, None
        fitted = [_fit(x, item) for x in value]
        return all(ok for ok, _ in fitted), [x for _, x in fitted]
    if isinstance(ann, type):
        return isinstance(value, ann), value
    return True, value  # an annotation this check does not read


def _describe(ann) -> str:
    if typing.get_origin(ann) in (types.UnionType, typing.Union):
        parts = [_describe(a) for a in typing.get_args(ann)]
        return ", ".join(parts[:-1]) + " or " + parts[-1]
    if ann is None or ann is type(None):
        return "None"
    if typing.get_origin(ann) is list:
        return f"a list of {typing.get_args(ann)[0].__name__}"
    return {bool: "a bool (True or False)", int: "an int", float: "a real number", str: "a str"}.get(
        ann, f"a {getattr(ann, '__name__', ann)}")
