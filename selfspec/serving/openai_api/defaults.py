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

from selfspec.engine.sequence import SamplingParams


@dataclass(frozen=True)
class Defaults:
    """Sampling for a request that names none (the engine's `SamplingParams`, checked there;
    temperature 0 is greedy) and where it came from: "server" or the generation_config.json path."""

    params: SamplingParams = SamplingParams(max_new_tokens=256)
    source: str = "server"

    @property
    def max_tokens(self) -> int:
        return self.params.max_new_tokens


def model_defaults(checkpoint_dir: str | None, max_tokens: int | None = None) -> Defaults:
    """Defaults from `checkpoint_dir/generation_config.json` when it exists; `max_tokens` (the
    server's `--max-tokens`) wins over the file's `max_new_tokens`. A file that cannot be read is
    a ValueError naming it (the server refuses to start rather than guess)."""
    path = os.path.join(checkpoint_dir, "generation_config.json") if checkpoint_dir else None
    fallback = Defaults.params.max_new_tokens
    if path is None or not os.path.isfile(path):
        return Defaults(SamplingParams(max_new_tokens=max_tokens or fallback))
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path} must hold a JSON object")
    sampled = gen.get("do_sample") is True
    return Defaults(SamplingParams(
        max_new_tokens=max_tokens or _positive_int(gen.get("max_new_tokens"), fallback),
        temperature=_number(gen.get("temperature"), 1.0, 0.0, 100.0) if sampled else 0.0,
        top_p=_number(gen.get("top_p"), 1.0, 1e-9, 1.0) if sampled else 1.0,
        top_k=_positive_int(gen.get("top_k"), 0) if sampled else 0), source=path)


def _number(v, fallback: float, lo: float, hi: float) -> float:
    """The file's value when it is a number in [lo, hi] (a value sampling cannot use is ignored)."""
    return float(v) if type(v) in (int, float) and lo <= v <= hi else fallback


def _positive_int(v, fallback: int) -> int:
    return v if type(v) is int and v >= 1 else fallback
