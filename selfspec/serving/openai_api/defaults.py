"""What a request gets for the fields it leaves out: the model's own generation settings.

A checkpoint's `generation_config.json` (transformers' file) says how its authors meant it to be
sampled. Its meaning is transformers': without `"do_sample": true` the model decodes greedily
(whatever `temperature` says), and `max_new_tokens` bounds an answer. What the file does not say
falls back to the server's options (`--max-tokens`; greedy, top-p 1, top-k off).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Defaults:
    """Sampling for a request that names none: temperature 0 is greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    source: str = "server"  # where they came from: "server" or the generation_config.json path

    def __post_init__(self):
        if type(self.max_tokens) is not int or self.max_tokens < 1:
            raise ValueError(f"the default max tokens must be an integer >= 1, got {self.max_tokens!r}")


def model_defaults(checkpoint_dir: str | None, max_tokens: int | None = None) -> Defaults:
    """Defaults from `checkpoint_dir/generation_config.json` when it exists; `max_tokens` (the
    server's `--max-tokens`) wins over the file's `max_new_tokens`. A file that cannot be read is
    a ValueError naming it (the server refuses to start rather than guess)."""
    path = os.path.join(checkpoint_dir, "generation_config.json") if checkpoint_dir else None
    if path is None or not os.path.isfile(path):
        return Defaults() if max_tokens is None else Defaults(max_tokens=max_tokens)
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path} must hold a JSON object")
    sampled = gen.get("do_sample") is True
    return Defaults(
        max_tokens=max_tokens or _positive_int(gen.get("max_new_tokens"), Defaults.max_tokens),
        temperature=_number(gen.get("temperature"), 1.0, 0.0, 100.0) if sampled else 0.0,
        top_p=_number(gen.get("top_p"), 1.0, 1e-9, 1.0) if sampled else 1.0,
        top_k=_positive_int(gen.get("top_k"), 0) if sampled else 0,
        source=path)


def _number(v, fallback: float, lo: float, hi: float) -> float:
    """The file's value when it is a number in [lo, hi] (a value sampling cannot use is ignored)."""
    return float(v) if type(v) in (int, float) and lo <= v <= hi else fallback


def _positive_int(v, fallback: int) -> int:
    return v if type(v) is int and v >= 1 else fallback
