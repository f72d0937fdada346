"""Streaming is the primitive: `stream()` yields text deltas as rounds commit; `generate()`
drains it. Detokenisation is incremental and never splits a multi-byte character or a merge;
stop strings are matched across round boundaries (text that could start a stop string is held
back until it is decided); HF streamers (`TextStreamer`, `TextIteratorStreamer`) get `put` per
round and `end` once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.engine.options import DecodeConfig, check_args
from selfspec.checkpoint.tokenizer import IncrementalDetokenizer
from selfspec.engine.decoder import Decoder, Stats
from selfspec.engine.request import check_request


def _held_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


@dataclass
class Generation:
    """An iterable of text deltas; after iteration holds the text, the ids, the stats and why it stopped.

    finish_reason: "eos", "length", "stop_string", or "interrupted" (a KeyboardInterrupt, which
    still propagates; `text` then holds what was yielded and `token_ids` every committed id).
    """

    decoder: Decoder
    tokenizer: object
    stop: list[str] = field(default_factory=list)
    streamer: object | None = None
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    trace: object | None = None  # a selfspec.trace.Trace when stream(..., trace=True)

    @property
    def stats(self) -> Stats:
        return self.decoder.stats

    def __iter__(self):
        detok = IncrementalDetokenizer(self.tokenizer)
        pending = ""  # decoded but held back (could begin a stop string)
        eos = self.decoder.eos
        try:
            if self.streamer is not None:
                self.streamer.put(torch.tensor([self.decoder.prompt]))
            for chunk in self.decoder:
                self.token_ids.extend(chunk)
                if self.trace is not None:
                    self.trace.add_chunk(chunk)
                if self.streamer is not None and chunk:
                    self.streamer.put(torch.tensor(chunk))
                pending += detok.push(chunk)
                hit = self._find_stop(pending)
                if hit is not None:
                    cut, stop_len = hit
                    self._trim_ids_to_stop(detok, len(self.text) + cut + stop_len)
                    self.finish_reason = "stop_string"
                    out, pending = pending[:cut], ""
                    self.text += out
                    if out:
                        yield out
                    return
                hold = _held_suffix(pending, self.stop)
                out, pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
                if out:
                    self.text += out
                    yield out
            pending += detok.flush()
            if pending:
                self.text += pending
                yield pending
            last = self.token_ids[-1] if self.token_ids else None
            self.finish_reason = "eos" if last in eos else "length"
        except KeyboardInterrupt:
            # the caller decides what to show; `text` / `token_ids` hold what was committed so far
            self.finish_reason = "interrupted"
            raise
        finally:
            if self.streamer is not None:
                self.streamer.end()

    def _find_stop(self, pending: str):
        best = None
        for s in self.stop:
            window = self.text[-(len(s) - 1) :] if len(s) > 1 else ""
            i = (window + pending).find(s)
            if i >= 0:
                cut = i - len(window)
                if best is None or cut < best[0]:
                    best = (cut, len(s))
        return best

    def _trim_ids_to_stop(self, detok: IncrementalDetokenizer, n_chars: int) -> None:
        """Keep the shortest id prefix whose text covers the stop string."""
        for k in range(1, len(self.token_ids) + 1):
            if len(self.tokenizer.decode(self.token_ids[:k], skip_special_tokens=True)) >= n_chars:
                del self.token_ids[k:]
                return


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Plain text -> ids (the tokenizer's own special-token rule); chat messages -> chat template."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat messages were given but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers v5 returns a BatchEncoding
            ids = ids["input_ids"]
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string or a list of chat messages, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("empty prompt")
    return list(tokenizer.encode(prompt))


def stream(model, tokenizer, prompt, *, seed: int | None = None, generator: torch.Generator | None = None,
           eos_token_id: int | list[int] | None = None, stop: str | list[str] | None = None, streamer=None,
           profile=None, trace: bool = False, **decode) -> Generation:
    """Start a generation; iterate the result for text deltas. All errors are raised here.

    `decode` holds the `DecodeConfig` fields (max_new_tokens, plan, mode, schedule, block_length,
    group_size, group_nodes, temperature, top_k, top_p, budget, tree_top_k, lam, rho).
    `profile` (plan "auto"): a cost-profile path or `profile.CostProfile`; default: this
    device's cached profile, measured on first use.
    trace=True records every round (`selfspec.trace`): the result's `.trace.to_html()`.
    An unknown option is a ValueError; a value of the wrong type (here or in `decode`) a TypeError
    naming it.
    """
    if _is_batch(prompt):  # a list of prompts: `selfspec.batching` (iterate for (row, delta))
        from selfspec.batching import stream_batch

        return stream_batch(model, tokenizer, prompt, encode=encode_prompt, seed=seed, generator=generator,
                            eos_token_id=eos_token_id, stop=stop, streamer=streamer, profile=profile, trace=trace,
                            **decode)
    cfg = DecodeConfig.from_options(decode)
    typed = check_args(stream, seed=seed, generator=generator, eos_token_id=eos_token_id, stop=stop, trace=trace)
    seed, eos_token_id, stop = typed["seed"], typed["eos_token_id"], typed["stop"]
    ids = prompt if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int) else encode_prompt(tokenizer, prompt)
    check_request(model, ids, cfg)
    if generator is None and seed is not None:
        generator = torch.Generator(device=model.get_input_embeddings().weight.device).manual_seed(seed)
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    if cfg.mode == "auto":
        from selfspec.engine.profile import cost_model

        profile = cost_model(model, profile)  # a bad profile file fails here, before any model work
    dec = Decoder(model, ids, cfg, eos_token_id=eos_token_id, generator=generator, profile=profile)
    gen = Generation(dec, tokenizer, stops, streamer)
    if trace:
        from dataclasses import asdict

        from selfspec.trace import Trace

        gen.trace = Trace(tokenizer, ids, settings=asdict(cfg))
        dec.on_round = gen.trace.add
    return gen


def generate(model, tokenizer, prompt, **kwargs) -> Generation:
    """Run to the end; returns the finished `Generation` (.text, .token_ids, .stats), or for a list
    of prompts one `batching.RowResult` per prompt, in input order."""
    gen = stream(model, tokenizer, prompt, **kwargs)
    for _ in gen:
        pass
    return gen.results if _is_batch(prompt) else gen


def _is_batch(prompt) -> bool:
    from selfspec.batching import is_batch

    return is_batch(prompt)
