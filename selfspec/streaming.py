"""Streaming is the primitive: `stream()` yields text deltas as rounds commit; `generate()` drains
it. One front door for one prompt or a list: the request is checked once (options, prompts, seeds,
eos, stop strings, profile, trace), before any model work, and decoded by one
`engine.decoder.Decoder` (a single prompt is a batch of one row).

Detokenisation is incremental and never splits a multi-byte character or a merge; stop strings
are matched across round boundaries (text that could start a stop string is held back until it
is decided), per row in a batch (a row that hits one leaves the batch); HF streamers
(`TextStreamer`, `TextIteratorStreamer`) get `put` per round and `end` once (one prompt only).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from selfspec.checkpoint.synthetic import refuse
from selfspec.checkpoint.tokenizer import IncrementalDetokenizer
from selfspec.engine.schedule.decoder import Decoder
from selfspec.engine.request.options import DecodeConfig, check_args
from selfspec.engine.request.stats import Stats


@dataclass
class RowResult:
    """One prompt's result (text, ids, stats, why it stopped, trace), filled as it streams.

    finish_reason: "eos", "length", "stop_string", or "interrupted" (a KeyboardInterrupt, which
    still propagates; `text` then holds what was yielded and `token_ids` every committed id)."""

    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None
    trace: object | None = None  # a selfspec.trace.Trace when trace=True


class RowText:
    """One row's text: incremental detokenisation, stop strings held back until decided.

    `push(chunk)` returns the text the chunk adds and sets `res.finish_reason` when the row ends
    ("eos", "length", "stop_string"); `finish()` releases what is held back once the decoder is
    done with the row (a cancelled row, say). Used by `BatchGeneration` and the server."""

    def __init__(self, res: RowResult, tokenizer, stops: list[str], eos: set[int], max_new_tokens: int):
        self.res, self.tok, self.stops, self.eos, self.max_new = res, tokenizer, stops, eos, max_new_tokens
        self.detok, self.pending = IncrementalDetokenizer(tokenizer), ""

    def push(self, chunk: list[int]) -> str:
        """The text this chunk adds (after stop-string handling); sets `finish_reason` at the end."""
        res = self.res
        res.token_ids.extend(chunk)
        if res.trace is not None:
            res.trace.add_chunk(chunk)
        self.pending += self.detok.push(chunk)
        hit = self._find_stop()
        if hit is not None:
            cut, stop_len = hit
            self._trim_ids(len(res.text) + cut + stop_len)
            res.finish_reason = "stop_string"
            out, self.pending = self.pending[:cut], ""
        else:
            ended = len(res.token_ids) >= self.max_new or (chunk and chunk[-1] in self.eos)
            if ended:
                self.pending += self.detok.flush()
                res.finish_reason = "eos" if res.token_ids[-1] in self.eos else "length"
            hold = 0 if ended else _held_suffix(self.pending, self.stops)
            out, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold :]
        res.text += out
        return out

    def finish(self) -> str:
        """The decoder is done with this row: release what was held back, name the reason."""
        res = self.res
        if res.finish_reason is not None:
            return ""
        out, self.pending = self.pending + self.detok.flush(), ""
        res.finish_reason = "eos" if res.token_ids and res.token_ids[-1] in self.eos else "length"
        res.text += out
        return out

    def _find_stop(self):
        best = None
        for s in self.stops:
            window = self.res.text[-(len(s) - 1) :] if len(s) > 1 else ""
            i = (window + self.pending).find(s)
            if i >= 0:
                cut = i - len(window)
                if best is None or cut < best[0]:
                    best = (cut, len(s))
        return best

    def _trim_ids(self, n_chars: int) -> None:
        """Keep the shortest id prefix whose text covers the stop string."""
        ids = self.res.token_ids
        for k in range(1, len(ids) + 1):
            if len(self.tok.decode(ids[:k], skip_special_tokens=True)) >= n_chars:
                del ids[k:]
                return


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
class BatchGeneration:
    """Iterate for `(row, text_delta)` as rows commit; afterwards `results[i]` is prompt i's."""

    decoder: Decoder
    tokenizer: object
    results: list[RowResult]
    stop: list[str] = field(default_factory=list)
    streamer: object | None = None

    def rows(self):
        """`(row, delta)` for every row's text as it commits; a row that hits a stop string leaves."""
        dec = self.decoder
        texts = [RowText(r, self.tokenizer, self.stop, dec.eos, p.max_new_tokens)
                 for r, p in zip(self.results, dec.params)]
        steps = iter(dec)
        try:
            if self.streamer is not None:
                self.streamer.put(torch.tensor([self.results[0].prompt_ids]))
            for row, chunk in steps:
                if self.streamer is not None and chunk:
                    self.streamer.put(torch.tensor(chunk))
                out = texts[row].push(chunk)
                if out:
                    yield row, out
                if self.results[row].finish_reason == "stop_string":
                    dec.cancel(dec.sequences[row])
            for row, text in enumerate(texts):  # the decoder ended: whatever is held back is text
                out = text.finish()
                if out:
                    yield row, out
        except KeyboardInterrupt:
            for r in self.results:  # the caller decides what to show; the results hold what was committed
                r.finish_reason = r.finish_reason or "interrupted"
            raise
        finally:
            steps.close()
            if self.streamer is not None:
                self.streamer.end()

    def __iter__(self):
        return self.rows()


@dataclass
class Generation(BatchGeneration):
    """One prompt: iterate for text deltas; afterwards `.text`, `.token_ids`, `.stats`,
    `.finish_reason` and `.trace` (see `RowResult`)."""

    def __iter__(self):
        for _, out in self.rows():
            yield out

    text = property(lambda self: self.results[0].text)
    token_ids = property(lambda self: self.results[0].token_ids)
    stats = property(lambda self: self.results[0].stats)
    finish_reason = property(lambda self: self.results[0].finish_reason)
    trace = property(lambda self: self.results[0].trace)


def is_batch(prompt) -> bool:
    """A list of prompts (texts, id lists or chat message lists), as opposed to one prompt."""
    if not isinstance(prompt, (list, tuple)):
        return False
    if not prompt:
        return True  # an empty batch: rejected with a clear error
    return not isinstance(prompt[0], (int, dict))


def encode_prompt(tokenizer, prompt) -> list[int]:
    """Ids as given; plain text -> ids (the tokenizer's own special-token rule); chat messages -> the
    chat template."""
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
        return list(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], dict):
        refuse(tokenizer, "chat (messages through a chat template)")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("chat messages were given but the tokenizer has no chat template")
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers v5 returns a BatchEncoding
            ids = ids["input_ids"]
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return [int(i) for i in (ids[0] if ids and isinstance(ids[0], list) else ids)]
    if isinstance(prompt, (list, tuple)) and not prompt:
        raise ValueError("empty prompt: at least one token is needed")
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a string, a list of token ids or a list of chat messages, "
                        f"got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("empty prompt")
    return list(tokenizer.encode(prompt))


def stream(model, tokenizer, prompt, *, seed: int | list[int] | None = None, generator: torch.Generator | None = None,
           eos_token_id: int | list[int] | None = None, stop: str | list[str] | None = None, streamer=None,
           profile=None, trace: bool = False, batch_size: int | None = None, max_cache_bytes: int | None = None,
           past: "Generation | None" = None, replay=None, **decode) -> Generation | BatchGeneration:
    """Start a generation of one prompt (iterate for text deltas) or of a list of prompts (iterate
    for `(row, delta)`; `batch_size` rows at once). Every error is raised here, before any model work.

    `decode` holds the `DecodeConfig` fields (max_new_tokens, plan, mode, schedule, block_length,
    group_size, group_nodes, temperature, top_k, top_p, budget, tree_top_k, lam, rho, draft_lora,
    lookup, lookup_min_ngram, lookup_max_ngram, lookup_tokens). `seed`: an int (a batch: row i
    uses seed + i) or one per prompt; `generator`: one prompt only. `stop`: stop strings (per row).
    `profile` (plan "auto"): a cost-model path or `cost.CostModel`; default: this device's, measured
    on first use. `trace=True` records every round (`selfspec.trace`): `.trace.to_html()`.
    `past`: the previous turn of a conversation, a `Generation` of this model that ran (finished or
    stopped): this one continues in its KV cache, so the part of the prompt that turn held (its
    prompt and answer, as far as this prompt starts with them) is not prefilled again (the exact
    weight formats; elsewhere, or after the weights changed, it starts afresh). Each generation is
    continued once: pass the latest one.
    `replay`: a replay profile (a built-in name such as "nld-8b", a JSON file's path or a
    `drafting.replay.ReplayProfile`): the draft marginals are replaced by the profile's calibrated
    ones, drawn against the prompt's greedy AR output (decoded first, untimed); greedy only; the
    output is still verified (equals AR's); `stats.replay` names the profile (docs/replay.md).
    An unknown option is a ValueError; a value of the wrong type (here or in `decode`) a TypeError
    naming it.
    """
    batch = is_batch(prompt)
    cfg = DecodeConfig.from_options(decode)
    typed = check_args(stream, seed=seed, generator=generator, eos_token_id=eos_token_id, stop=stop, trace=trace,
                       batch_size=batch_size, max_cache_bytes=max_cache_bytes)
    seed, eos_token_id, stop = typed["seed"], typed["eos_token_id"], typed["stop"]
    prompts = list(prompt) if batch else [prompt]
    if batch and not prompts:
        raise ValueError("empty batch: at least one prompt is needed")
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(encode_prompt(tokenizer, p))
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}" if batch else str(e)) from None
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    if batch and (generator is not None or streamer is not None):
        raise ValueError("generator= is one prompt's (a batch takes seed=int or a list of seeds)"
                         if generator is not None else "streamer= takes one prompt, not a batch")
    if past is not None:
        _check_past(past, model, batch)
    if profile is not None and cfg.plan != "auto":
        raise ValueError("profile= is read by plan 'auto' only; this generation runs a fixed mode")
    seeds = _seeds(seed, len(ids), batch)
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
    dec = Decoder(model, ids, cfg, batch_size=batch_size, eos_token_id=eos_token_id, seeds=seeds,
                  generators=None if generator is None else [generator], max_cache_bytes=max_cache_bytes,
                  profile=profile, past=None if past is None else past.decoder, replay=replay)
    results = [RowResult(p, stats=st) for p, st in zip(ids, dec.stats)]
    if trace:
        from selfspec.trace import Trace

        for res in results:
            res.trace = Trace(tokenizer, res.prompt_ids, settings=asdict(cfg))
        dec.on_round = lambda info: results[info["row"]].trace.add(info)
    cls = BatchGeneration if batch else Generation
    return cls(dec, tokenizer, results, stops, streamer)


def _check_past(past, model, batch: bool) -> None:
    """`past=` is one finished (or stopped) generation of `model`, not continued yet."""
    if not isinstance(past, Generation):
        raise TypeError(f"past must be a Generation (of selfspec.stream / generate with one prompt), "
                        f"got {type(past).__name__}")
    if batch:
        raise ValueError("past= continues one conversation: give one prompt, not a batch")
    dec = past.decoder
    if dec.model is not model:
        raise ValueError("past= is a generation of another model")
    if not dec.closed:
        raise ValueError("past= has not run: iterate it to its end (or stop it) first")
    if dec.cache is None:
        raise ValueError("past= was continued already: pass the latest generation of the conversation")


def _seeds(seed, n: int, batch: bool) -> list[int] | None:
    if seed is None:
        return None
    if isinstance(seed, int):
        return [seed + i for i in range(n)]
    if not batch:
        raise TypeError("seed must be an int for one prompt (a list gives one seed per prompt of a batch)")
    seeds = list(seed)
    if len(seeds) != n:
        raise ValueError(f"{len(seeds)} seeds for {n} prompts: give one per prompt, or one int")
    return seeds


def generate(model, tokenizer, prompt, **kwargs):
    """Run to the end; returns the finished `Generation` (.text, .token_ids, .stats), or for a list
    of prompts one `RowResult` per prompt, in input order."""
    gen = stream(model, tokenizer, prompt, **kwargs)
    for _ in gen:
        pass
    return gen.results if isinstance(gen, BatchGeneration) and not isinstance(gen, Generation) else gen
