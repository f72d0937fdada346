"""What a request needs before any model work: its checks and its cache room."""

from __future__ import annotations

from selfspec.engine.forward import FastForward
from selfspec.engine.options import DecodeConfig


def check_request(model, prompt_ids, cfg: DecodeConfig) -> None:
    """Every request error, raised before any model work."""
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt: at least one token is needed")
    limit = model.config.max_position_embeddings
    need = len(prompt_ids) + cfg.max_new_tokens + lookahead(cfg)
    if need > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) + draft lookahead "
            f"needs {need} positions; the model has max_position_embeddings={limit}"
        )
    if cfg.rho == "learned" and cfg.mode in ("presto", "auto") and getattr(model, "presto_predictor", None) is None:
        raise ValueError("rho 'learned' needs a trained predictor (presto_predictor.safetensors next to the model; "
                         "make one with `python -m selfspec.training.predictor collect/train`); none is loaded")
    if not FastForward.supports(model):
        raise ValueError("selfspec's engine needs every weight on a device (no offloading to disk or the meta "
                         "device) and no sliding-window attention; this model has one of those")


def lookahead(cfg: DecodeConfig) -> int:
    """Positions a round may use beyond the committed text (draft block, mask group, copied chain)."""
    if cfg.mode == "ar":
        return 0
    if cfg.mode == "lookup":
        return cfg.lookup_tokens
    return max(cfg.block_length, cfg.group, cfg.lookup_tokens if cfg.lookup else 0)


def scratch(cfg: DecodeConfig, *, batch: bool = False) -> int:
    """Cache slots a round may write beyond the committed text (every query token of a round).

    AR writes one; lookup its chain and root; two-pass its draft block or its tree; one-pass and
    the batch-1 planner (which may choose one-pass) a tree with a group on every node; the batch
    planner (`batch=True`) AR, lookup chains or two-pass linear drafts."""
    if cfg.mode == "ar":
        return 1
    if cfg.mode == "lookup":
        return cfg.lookup_tokens + 1
    if cfg.mode == "auto" and batch:
        return max(cfg.block_length, cfg.lookup_tokens + 1)
    nodes = cfg.budget if cfg.mode in ("presto", "auto") else cfg.block_length - 1
    if cfg.mode != "auto" and cfg.schedule == "two-pass":
        return max(cfg.block_length, nodes + 1, cfg.lookup_tokens + 1 if cfg.lookup else 0)
    return max(cfg.block_length, (nodes + 1) * (cfg.group + 1), cfg.lookup_tokens + 1)
