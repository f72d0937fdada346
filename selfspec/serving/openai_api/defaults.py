"""What a request gets for the fields it leaves out: the model's own generation settings.

A checkpoint's `generation_config.json` (transformers' file) says how its authors meant it to be
sampled; `checkpoint.generation.read_generation_config` reads it (the same reader `selfspec chat`
uses). Its meaning is transformers': without `"do_sample": true` the model decodes greedily
(whatever `temperature` says), and `max_new_tokens` bounds an answer. What the file does not say
falls back to the server's options (`--max-tokens`; greedy, top-p 1, top-k off). Repetition
settings in the file (`repetition_penalty`, ...) are not applied: the runtime has none, and the
server logs that once at startup (`Defaults.unsupported_note`).
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.checkpoint.generation import read_generation_config, unsupported_note
from selfspec.engine.request.sequence import SamplingParams


@dataclass(frozen=True)
class Defaults:
    """Sampling for a request that names none (the engine's `SamplingParams`, checked there;
    temperature 0 is greedy) and where it came from: "server" or the generation_config.json path;
    `unsupported`: the file's settings that are not applied ((name, value) pairs)."""

    params: SamplingParams = SamplingParams(max_new_tokens=256)
    source: str = "server"
    unsupported: tuple = ()

    @property
    def max_tokens(self) -> int:
        return self.params.max_new_tokens

    def unsupported_note(self) -> str | None:
        return unsupported_note(self.source, self.unsupported)


def model_defaults(checkpoint_dir: str | None, max_tokens: int | None = None) -> Defaults:
    """Defaults from `checkpoint_dir/generation_config.json` when it exists; `max_tokens` (the
    server's `--max-tokens`) wins over the file's `max_new_tokens`. A file that cannot be read is
    a ValueError naming it (the server refuses to start rather than guess)."""
    gen = read_generation_config(checkpoint_dir)
    fallback = Defaults.params.max_new_tokens
    params = SamplingParams(max_new_tokens=max_tokens or gen.max_new_tokens or fallback, temperature=gen.temperature,
                            top_p=gen.top_p, top_k=gen.top_k)
    if gen.source is None:
        return Defaults(params)
    return Defaults(params, source=gen.source, unsupported=gen.unsupported)
