"""Acceptance replay's engine side: the profile checked and each prompt's reference decoded
before the replayed generation starts (`drafting.replay` builds the marginals from them)."""

from __future__ import annotations

from dataclasses import replace

from selfspec.drafting.replay import Replay, load_profile


def replaying(model, prompts: list[list[int]], cfg, params: list, spec, *, decoder, **kw) -> Replay:
    """A `Replay` for these prompts: the profile `spec` loaded (a bad one fails here, before any
    model work) and every prompt's greedy AR continuation decoded by `decoder(model, prompts,
    ar_cfg, params=params, **kw)` (the caller's decoder class, so that this module needs no import
    of it; untimed: the replayed run's stats never see it). Greedy only: at temperature > 0 the
    target's draws, not a fixed continuation, decide what is accepted, so a replay there is
    refused."""
    profile = load_profile(spec)
    if cfg.temperature > 0 or any(p.temperature > 0 for p in params):
        raise ValueError("replay replays greedy acceptance against the AR output: it needs temperature 0")
    ar = replace(cfg, mode="ar", plan=None, schedule=None, group_nodes=None, lookup=None)
    reference = decoder(model, prompts, ar, params=params, **kw)
    for _ in reference:
        pass
    outputs = reference.outputs
    return Replay(profile, {i: list(outputs[i]) for i in range(len(prompts))}, dict(enumerate(prompts)),
                  mask_id=int(model.config.mask_token_id), top_k=cfg.tree_top_k)
