"""Many prompts at once: `stream(model, tok, [p0, p1, ...])` / `generate(model, tok, [...])`.

`selfspec.streaming.stream` / `generate` hand a list of prompts here. A batch runs through
`engine.batch.BatchDecoder`: every row equals its batch-1 run at temperature 0 and is an exact
sample otherwise. Seeds: an int `seed` gives row i the seed `seed + i`; a list gives one per row.
Modes batched: "ar", "lookup", fixed "linear" / "presto" (two-pass and one-pass) and plan
"auto" (the batch planner: AR, lookup chains or two-pass linear drafts per round, chosen on the
batch cost profile; `profile=` takes a `batch_profile.BatchProfile` or its JSON path). A batch
of one row is a batch-1 generation (the batch-1 planner, its `profile.CostProfile`), unless
`profile=` is a batch profile (then the batch planner plans it).
`trace=True` gives every row its own `selfspec.trace.Trace` (`results[i].trace`). Stop strings
and HF streamers are batch-1 only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from selfspec.checkpoint.tokenizer import IncrementalDetokenizer
from selfspec.engine.batch import BatchDecoder
from selfspec.engine.options import DecodeConfig
from selfspec.engine.stats import Stats


def is_batch(prompt) -> bool:
    """A list of prompts (texts, id lists or chat message lists), as opposed to one prompt."""
    if not isinstance(prompt, (list, tuple)):
        return False
    if not prompt:
        return True  # an empty batch: rejected with a clear error
    return not isinstance(prompt[0], (int, dict))


@dataclass
class RowResult:
    """One prompt's result: like `Generation` after iteration (text, token_ids, stats, finish_reason)."""

    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None
    trace: object | None = None  # a selfspec.trace.Trace when trace=True


@dataclass
class BatchGeneration:
    """Iterate for `(row, text_delta)` as rows commit; afterwards `results[i]` is prompt i's."""

    decoder: BatchDecoder
    tokenizer: object
    results: list[RowResult] = field(default_factory=list)

    def __iter__(self):
        dec = self.decoder
        detoks = [IncrementalDetokenizer(self.tokenizer) for _ in self.results]
        for row, chunk in dec:
            res = self.results[row]
            res.token_ids.extend(chunk)
            if res.trace is not None:
                res.trace.add_chunk(chunk)
            out = detoks[row].push(chunk)
            if len(res.token_ids) >= dec.cfg.max_new_tokens or (chunk and chunk[-1] in dec.eos):
                out += detoks[row].flush()
                res.finish_reason = "eos" if res.token_ids[-1] in dec.eos else "length"
            if out:
                res.text += out
                yield row, out


def stream_batch(model, tokenizer, prompts, *, encode, seed=None, eos_token_id=None, batch_size: int | None = None,
                 max_cache_bytes: int | None = None, trace: bool = False, **decode) -> BatchGeneration:
    """Start a batch; every error is raised here, before any model work. `encode(tokenizer, prompt)`
    turns a text or chat prompt into ids (`streaming.encode_prompt`, handed in: no import circle)."""
    profile = decode.pop("profile", None)
    for k in ("generator", "stop", "streamer"):
        if decode.pop(k, None) not in (None, False, [], ""):
            raise ValueError(f"{k!r} is not supported for a batch of prompts (use seed=int or a list of seeds)"
                             if k == "generator" else f"{k!r} is not supported for a batch of prompts yet")
    try:
        cfg = DecodeConfig(**decode)
    except TypeError as e:
        raise ValueError(f"unknown decoding option: {e}") from None
    if len(prompts) == 0:
        raise ValueError("empty batch: at least one prompt is needed")
    ids = []
    for i, p in enumerate(prompts):
        if isinstance(p, (list, tuple)) and len(p) == 0:
            raise ValueError(f"empty prompt at index {i}")
        try:
            ids.append(list(p) if isinstance(p, (list, tuple)) and isinstance(p[0], int) else encode(tokenizer, p))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
    if seed is None:
        seeds = None
    elif isinstance(seed, int):
        seeds = [seed + i for i in range(len(ids))]
    else:
        seeds = list(seed)
        if len(seeds) != len(ids):
            raise ValueError(f"{len(seeds)} seeds for {len(ids)} prompts: give one per prompt, or one int")
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
    if profile is not None and cfg.mode != "auto":
        raise ValueError("profile= is read by plan 'auto' only; this batch runs a fixed mode")
    dec = BatchDecoder(model, ids, cfg, batch_size=batch_size, eos_token_id=eos_token_id, seeds=seeds,
                       max_cache_bytes=max_cache_bytes, profile=profile)
    results = [RowResult(p, stats=st) for p, st in zip(ids, dec.stats)]
    if trace:
        from dataclasses import asdict

        from selfspec.trace import Trace

        for res in results:
            res.trace = Trace(tokenizer, res.prompt_ids, settings=asdict(cfg))
        dec.on_round = lambda info: results[info["row"]].trace.add(info)
    return BatchGeneration(dec, tokenizer, results)
