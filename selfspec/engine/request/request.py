"""What a request needs before any model work: its checks (one prompt or a batch), its eos ids
and its cache room."""

from __future__ import annotations

import numbers

from selfspec.engine.forward.batch_forward import BatchForward
from selfspec.engine.forward.forward import FastForward
from selfspec.engine.request.options import DecodeConfig


def check_request(model, prompt_ids, cfg: DecodeConfig, params=None, *, engine: bool = True) -> None:
    """Every request error, raised before any model work. `params`: the prompt's own
    `sequence.SamplingParams` (default: the config's); `engine=False` leaves out whether the engine
    supports the model (a walk over every parameter: a batch asks it once)."""
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt: at least one token is needed")
    V = model.config.vocab_size
    bad = next((t for t in prompt_ids if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < V),
               None)
    if bad is not None:
        raise ValueError(f"token id {bad!r} is not in the model's vocabulary (0 .. {V - 1})")
    limit = model.config.max_position_embeddings
    new = (params or cfg).max_new_tokens
    need = len(prompt_ids) + new + lookahead(cfg)
    if need > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({new}) + draft lookahead "
            f"needs {need} positions; the model has max_position_embeddings={limit}"
        )
    if cfg.rho == "learned" and cfg.mode in ("presto", "auto") and getattr(model, "presto_predictor", None) is None:
        raise ValueError("rho 'learned' needs a trained predictor (presto_predictor.safetensors next to the model; "
                         "make one with `python -m selfspec.training.predictor collect/train`); none is loaded")
    if engine and not FastForward.supports(model):
        raise ValueError("selfspec's engine needs every weight on a device (no offloading to disk or the meta "
                         "device) and no sliding-window attention; this model has one of those")


def lookahead(cfg: DecodeConfig) -> int:
    """Positions a round may use beyond the committed text (draft block, mask group, copied chain)."""
    if cfg.mode == "ar":
        return 0
    if cfg.mode == "lookup":
        return cfg.lookup_tokens
    return max(cfg.block_length, cfg.group, cfg.lookup_tokens if cfg.lookup else 0)


def scratch(cfg: DecodeConfig) -> int:
    """Cache slots a round may write beyond the committed text (every query token of a round).

    AR writes one; lookup its chain and root; two-pass its draft block or its tree; one-pass and
    plan "auto" (which may choose one-pass, and pads a round only up to this) a tree with a group
    on every node."""
    if cfg.mode == "ar":
        return 1
    if cfg.mode == "lookup":
        return cfg.lookup_tokens + 1
    nodes = cfg.budget if cfg.mode in ("presto", "auto") else cfg.block_length - 1
    if cfg.plan != "auto" and cfg.schedule == "two-pass":
        return max(cfg.block_length, nodes + 1, cfg.lookup_tokens + 1 if cfg.lookup else 0)
    return max(cfg.block_length, (nodes + 1) * (cfg.group + 1), cfg.lookup_tokens + 1)


def eos_ids(model, eos_token_id=None) -> set[int]:
    """The ids that end a generation: the given id(s), else the model config's."""
    eos = eos_token_id if eos_token_id is not None else model.config.eos_token_id
    return set([eos] if isinstance(eos, int) else (eos or []))


MAX_CACHE_BYTES = 8 << 30  # default ceiling on a batch's KV cache


def check_batch(model, prompts_ids, cfg: DecodeConfig, batch_size: int | None, generators=None,
                max_cache_bytes: int | None = None):
    """Every request error of a batch (one prompt is a batch of one; a server's decoder starts with
    none and a `batch_size`), raised before any model work. Returns the model's `BatchForward` (the
    cache check's) when there are prompts, else None."""
    if not isinstance(prompts_ids, (list, tuple)) or (len(prompts_ids) == 0 and batch_size is None):
        raise ValueError("empty batch: at least one prompt is needed")
    for i, p in enumerate(prompts_ids):
        if len(p) == 0:
            raise ValueError("empty prompt: at least one token is needed" if len(prompts_ids) == 1
                             else f"empty prompt at index {i}: at least one token is needed")
        check_request(model, p, cfg, engine=i == 0)
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if generators is not None and len(generators) != len(prompts_ids):
        raise ValueError(f"{len(generators)} per-row generators / seeds for {len(prompts_ids)} prompts")
    if not prompts_ids:
        return None
    rows, bf = min(batch_size or len(prompts_ids), len(prompts_ids)), BatchForward.of(model)
    cache_bytes(bf, rows, row_capacity(prompts_ids, cfg), max_cache_bytes)
    return bf


def cache_bytes(bf, rows: int, capacity: int, limit: int | None = None) -> int:
    """Bytes of a KV cache of `rows` rows of `capacity` slots, or a ValueError over `limit`
    (default MAX_CACHE_BYTES)."""
    need = bf.cache_bytes(rows, capacity)
    limit = MAX_CACHE_BYTES if limit is None else limit
    if need > limit:
        raise ValueError(f"a batch of {rows} rows needs {need / 2**20:.1f} MiB of KV cache, over the limit of "
                         f"{limit / 2**20:.1f} MiB; use a smaller batch_size or max_new_tokens")
    return need


ROUND_SCRATCH = 64  # slots a row keeps for a round's query tokens; a wider round grows the cache


def round_room(cfg: DecodeConfig) -> int:
    """Slots a row keeps past its text for a round's query tokens; a wider round grows the cache
    before it writes (`BatchForward._segment`). A fixed layout keeps its own rounds' (`scratch`),
    up to ROUND_SCRATCH. Mode "auto" keeps what its usual rounds take (a lookup chain and its root,
    a probe's mask group on the root, a draft pass of block_length), not the widest round it may
    choose: slots past what a round reads still slow every forward over the rows), and on a CPU's cost curve its rounds are 17 tokens wide at most.

    Example (defaults): AR 1, lookup 11, a fixed one-pass PRESTO tree 64 (of 561), auto 17."""
    if cfg.mode == "auto":
        return min(scratch(cfg), max(cfg.block_length, cfg.group + 1, cfg.lookup_tokens + 1), ROUND_SCRATCH)
    return min(scratch(cfg), ROUND_SCRATCH)


def row_slots(tokens: int, cfg: DecodeConfig) -> int:
    """Cache slots of a row that holds `tokens` tokens of text: those, a round's room (`round_room`)
    and the root's slot."""
    return tokens + round_room(cfg) + 1


def row_capacity(prompts_ids, cfg: DecodeConfig, params=None) -> int:
    """Cache slots per row: the longest prompt and its new tokens (`row_slots`)."""
    return row_slots(max(len(p) for p in prompts_ids) + (params or cfg).max_new_tokens, cfg)
