"""A checkpoint's own sampling settings: transformers' `generation_config.json`, read in one place.

The layers that sample by the model's defaults read it from here: the server, for the fields a
request leaves out (`serving/openai_api/defaults.py`), and `selfspec chat`, for the flags not
given. `generate` (Python and the CLI) does not: like transformers' `generate`, it is greedy
unless asked.

The file's meaning is transformers': without `"do_sample": true` the model decodes greedily
(whatever `temperature` says); with it, `temperature` (default 1.0), `top_p` and `top_k` shape the
draw. `max_new_tokens` bounds an answer. The runtime has no repetition penalties: a file that sets
`repetition_penalty` (other than 1) or `no_repeat_ngram_size` gets them listed in `unsupported`
(the caller says so once) and they are not applied.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

FILE = "generation_config.json"
# transformers' repetition settings, with the value that means "off"; selfspec applies none of them
REPETITION = {"repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0}


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling as the checkpoint's authors meant it (temperature 0 is greedy); `source` is the
    file's path (None: the checkpoint has none), `unsupported` the (name, value) pairs it sets
    that the runtime cannot apply."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int | None = None
    source: str | None = None
    unsupported: tuple[tuple[str, object], ...] = ()

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    def describe(self) -> str:
        """"temperature 0.2, top-p 0.9" or "greedy"."""
        if not self.sampled:
            return "greedy"
        parts = [f"temperature {self.temperature:g}"]
        if self.top_p < 1.0:
            parts.append(f"top-p {self.top_p:g}")
        if self.top_k:
            parts.append(f"top-k {self.top_k}")
        return ", ".join(parts)

    def unsupported_note(self) -> str | None:
        return unsupported_note(self.source, self.unsupported)


def unsupported_note(source: str | None, unsupported) -> str | None:
    """One sentence on what the file asks for that is not applied, or None."""
    if not unsupported:
        return None
    what = ", ".join(f"{k} {v}" for k, v in unsupported)
    return f"{source} sets {what}: selfspec has no repetition penalties, so this is not applied"


def read_generation_config(checkpoint_dir: str | os.PathLike | None) -> GenerationSettings:
    """`checkpoint_dir/generation_config.json`'s sampling (greedy when there is no file). A value
    sampling cannot use (a negative temperature, top_p above 1, a string) is left at its default;
    a file that is not a JSON object is a ValueError naming it (callers refuse to guess)."""
    path = os.path.join(os.fspath(checkpoint_dir), FILE) if checkpoint_dir else None
    if path is None or not os.path.isfile(path):
        return GenerationSettings()
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(gen, dict):
        raise ValueError(f"{path} must hold a JSON object")
    sampled = gen.get("do_sample") is True
    unsupported = tuple((k, gen[k]) for k, off in REPETITION.items()
                        if type(gen.get(k)) in (int, float) and gen[k] != off)
    return GenerationSettings(
        temperature=_number(gen.get("temperature"), 1.0, 0.0, 100.0) if sampled else 0.0,
        top_p=_number(gen.get("top_p"), 1.0, 1e-9, 1.0) if sampled else 1.0,
        top_k=_positive_int(gen.get("top_k"), 0) if sampled else 0,
        max_new_tokens=_positive_int(gen.get("max_new_tokens"), None),
        source=path, unsupported=unsupported)


def _number(v, fallback: float, lo: float, hi: float) -> float:
    """The file's value when it is a number in [lo, hi] (a value sampling cannot use is ignored)."""
    return float(v) if type(v) in (int, float) and lo <= v <= hi else fallback


def _positive_int(v, fallback):
    return v if type(v) is int and v >= 1 else fallback
