"""Which planner a generation gets: forked from the one stored on the model for its settings, so
that what earlier generations learnt (acceptance calibration, overheads, time scales) starts it,
and stored back when the generation ends. Generations in several threads each work on their own
fork; the last to finish is kept."""

from __future__ import annotations

import threading

from selfspec.engine.planning.planner import Planner

_STORE_LOCK = threading.Lock()


def planner_for(model, cfg, cost, *, replay: str | None = None) -> Planner:
    """A planner for one generation with these settings, forked from the model's stored one so
    that what earlier generations learnt (acceptance calibration, overheads) starts this one
    (fading); `keep_planner` stores it back when the generation ends. A replayed generation
    (`replay`: its profile's name) learns apart: its acceptance is not the model's."""
    key = (id(cost), cfg.mode, cfg.temperature, cfg.top_k, cfg.top_p, cfg.budget, cfg.tree_top_k, cfg.block_length, cfg.group,
           cfg.lam, cfg.rho, cfg.lookup, cfg.lookup_min_ngram, cfg.lookup_max_ngram, cfg.lookup_tokens, replay)
    with _STORE_LOCK:
        store = model.__dict__.setdefault("_selfspec_planners", {})
        stored = store.get(key)
        if stored is None:
            if len(store) > 32:
                store.clear()
            stored = store[key] = Planner(cost, cfg)
        planner = stored.fork()
    planner.begin()
    planner.home = (store, key)
    return planner


def keep_planner(planner: Planner) -> None:
    """A finished generation's planner becomes the stored one for its settings (of generations
    running at once, the last to finish; none of them ever sees another's half-updated state)."""
    home = getattr(planner, "home", None)
    planner.shadows = {}  # chains still followed hold their sequences (a long prompt's index): nothing to learn now
    if home is not None:
        with _STORE_LOCK:
            home[0][home[1]] = planner
