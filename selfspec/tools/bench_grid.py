"""The bench's rows: which `DecodeConfig`s a mode list runs, and each row's label."""

from __future__ import annotations

from selfspec.engine.round.rounds import config_label, layout_label
from selfspec.engine.request.options import DecodeConfig


def grid(modes, schedules, budgets, base: dict) -> list[DecodeConfig]:
    out = []
    if "ar" in modes:
        out.append(DecodeConfig(**{**base, "mode": "ar", "schedule": "two-pass"}))
    if "auto" in modes:
        out.append(DecodeConfig(**{**base, "mode": "auto"}))
    if "lookup" in modes:
        out.append(DecodeConfig(**{**base, "mode": "lookup"}))
    if "linear" in modes:  # a linear chain has fixed schedules only
        out.extend(DecodeConfig(**{**base, "mode": "linear", "schedule": s})
                   for s in [s for s in schedules if s != "auto"] or ["two-pass"])
    for s in schedules:
        s = None if s == "auto" else s  # PRESTO laid out per round as this device affords
        if "presto" in modes:
            out.extend(DecodeConfig(**{**base, "mode": "presto", "schedule": s, "budget": b, "lookup": False})
                       for b in budgets)
        if "hybrid" in modes:  # PRESTO with each path's context continuations among the candidates
            out.extend(DecodeConfig(**{**base, "mode": "presto", "schedule": s, "budget": b, "lookup": True})
                       for b in budgets)
    return out


def label(cfg: DecodeConfig) -> str:
    """The engine's label of the setting; PRESTO with context candidates is the row "hybrid"."""
    if cfg.mode == "presto" and cfg.lookup:
        return layout_label("hybrid", schedule=cfg.schedule or "auto", nodes=cfg.budget)
    return config_label(cfg)
