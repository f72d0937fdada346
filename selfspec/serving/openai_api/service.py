"""The asyncio side of the server: admission, prompt encoding and the drain at shutdown.

Everything here runs on the event loop (one thread), so the count of admitted requests needs no
lock. A request is admitted while fewer than `max_batch + max_queue` are running, waiting or being
tokenized (`--max-batch` cache rows, then a bounded queue); one more is a 429 at once, before its
prompt is tokenized, never an unbounded wait. A text prompt is sized before it is tokenized (one
that cannot fit is refused unread, `prompt_size`) and a long one is tokenized in a worker thread,
so that no request stalls the loop the other streams are written from. The decoder itself lives in
the engine thread (`engine.Engine`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from selfspec.engine.schedule.decoder import Decoder
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.request.request import MAX_CACHE_BYTES, check_request, lookahead, row_capacity
from selfspec.engine.request.sequence import SamplingParams
from selfspec.serving.openai_api import errors
from selfspec.serving.openai_api.defaults import Defaults
from selfspec.serving.openai_api.engine import GATHER_WINDOW, STREAM_INTERVAL, Engine, Failed, Finished, Job
from selfspec.serving.openai_api.prompt_size import prompt_bytes, text_bytes_per_token
from selfspec.serving.openai_api.protocol import GenerationRequest
from selfspec.streaming import encode_prompt

log = logging.getLogger("selfspec.serve")
RESERVED_PROMPT = 128  # prompt tokens per row the cache holds from startup (longer prompts grow it once)
INLINE_BYTES = 4096  # a prompt of at most this much text is tokenized on the loop (a thread hop costs more)


@dataclass(frozen=True)
class ServiceOptions:
    """How many requests run (cache rows) and wait, and how long a shutdown lets them finish."""

    model_id: str
    aliases: tuple[str, ...] = ()  # other names accepted for the model (the --model argument as given)
    max_batch: int = 16
    max_queue: int = 64
    shutdown_timeout: float = 30.0
    defaults: Defaults = Defaults()
    max_context: int | None = None  # tokens a request may have, prompt + max_tokens (--max-context); None: the model's
    burst_window: float = GATHER_WINDOW  # seconds an idle engine waits after a request for another (`Engine._gather`)
    stream_interval: float = STREAM_INTERVAL  # seconds between a stream's deltas at least (`Engine._send`)

    def __post_init__(self):
        if type(self.max_batch) is not int or self.max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {self.max_batch!r}")
        if type(self.max_queue) is not int or self.max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {self.max_queue!r}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout!r}")
        if not self.model_id:
            raise ValueError("the served model needs a non-empty name")
        if not 0 <= self.burst_window <= 1:
            raise ValueError(f"burst_window must be between 0 and 1 second, got {self.burst_window!r}")
        if not 0 <= self.stream_interval <= 1:
            raise ValueError(f"stream_interval must be between 0 and 1 second, got {self.stream_interval!r}")
        if self.max_context is not None and (type(self.max_context) is not int or self.max_context < 2):
            raise ValueError(f"max_context must be an integer >= 2, got {self.max_context!r}")


class Service:
    """One model behind the HTTP endpoints: `open` a job for a checked request, read its `events`,
    `close` it (cancelling it when it has not finished: a client that went away frees its row)."""

    def __init__(self, model, tokenizer, cfg: DecodeConfig, options: ServiceOptions, *, profile=None,
                 eos_token_id=None):
        self.model, self.tok, self.cfg, self.options = model, tokenizer, cfg, options
        note = options.defaults.unsupported_note()  # e.g. a repetition_penalty: said once, not applied
        if note:
            log.warning(note)
        if eos_token_id is None:  # what selfspec.generate uses, so a greedy answer equals its output
            eos_token_id = model.config.eos_token_id
            if eos_token_id is None:
                eos_token_id = getattr(tokenizer, "eos_token_id", None)
        limit = model.config.max_position_embeddings - lookahead(cfg)
        if options.max_context is not None and options.max_context > limit:
            raise ValueError(f"max_context {options.max_context} is over the model's context ({limit} tokens a request "
                             f"with this layout's drafting lookahead)")
        new = options.defaults.max_tokens
        prompt = RESERVED_PROMPT
        if options.max_context is not None:  # no request outgrows max_context: reserve no more than that
            new = min(new, options.max_context - 1)
            prompt = max(1, min(prompt, options.max_context - new))

        def make_decoder() -> Decoder:
            dec = Decoder(model, [], cfg, batch_size=options.max_batch, eos_token_id=eos_token_id, profile=profile)
            try:  # the whole cache now, not while a burst of requests waits for its first tokens
                dec.reserve(prompt_tokens=prompt, max_new_tokens=new)
            except ValueError as e:
                log.warning("the KV cache is not reserved at startup (%s); it grows with the requests", e)
            return dec

        self.engine = Engine(make_decoder, tokenizer, window=options.burst_window)
        self.active: set[Job] = set()
        self.pending = 0  # requests admitted (`admitting`) whose job is not open yet: tokenizing
        # the most prompt tokens a request may have (one more token must fit), and the most bytes
        # of text they can stand for (None: the tokenizer may fold text, no bound before tokenizing)
        self.max_prompt_tokens = min(limit, options.max_context or limit) - 1
        self.bytes_per_token = None if tokenizer is None else text_bytes_per_token(tokenizer)
        self.max_prompt_bytes = None if self.bytes_per_token is None else self.bytes_per_token * self.max_prompt_tokens
        self._tokenizing = ThreadPoolExecutor(2, thread_name_prefix="selfspec-tokenize")
        self.draining = False
        self.created = int(time.time())

    @property
    def kv_cache_bytes(self) -> int:
        """What the engine's KV cache holds now (reserved at startup for `max_batch` rows)."""
        dec = self.engine.dec
        return 0 if dec.cache is None else dec.bf.cache_bytes(dec.cache.rows, dec.cache.capacity)

    @property
    def capacity(self) -> int:
        return self.options.max_batch + self.options.max_queue

    def start(self) -> None:
        self.engine.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.engine.stop, 30.0)
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    # -- one request -------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.options.model_id and name not in self.options.aliases:
            raise errors.model_not_found(name, self.options.model_id)

    @contextmanager
    def admitting(self):
        """Around a request's tokenizing and `open`: it counts against the capacity from here on,
        so a 429 (or a 503 while draining) comes before any expensive work."""
        if self.draining:
            raise errors.shutting_down()
        if len(self.active) + self.pending >= self.capacity:
            raise errors.queue_full(self.capacity)
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    async def encode(self, req: GenerationRequest) -> tuple[list[int], SamplingParams]:
        """The prompt's ids and the sampling parameters, checked against the model (400 on any
        problem; a prompt over the context is code "context_length_exceeded"), a long text
        prompt tokenized in a worker thread."""
        where = "messages" if req.kind == "chat" else "prompt"
        if req.kind == "chat" and not getattr(self.tok, "chat_template", None):
            raise errors.invalid("this model's tokenizer has no chat template; use /v1/completions with a text "
                                 "prompt", "messages", "no_chat_template")
        size = prompt_bytes(req.prompt)  # a 400 for text UTF-8 cannot encode (a lone surrogate)
        self._check_size(size, where)
        try:
            if size <= INLINE_BYTES:
                ids = encode_prompt(self.tok, req.prompt)
            else:
                ids = await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode_prompt, self.tok,
                                                                       req.prompt)
        except Exception as e:  # noqa: BLE001 - a chat template refuses messages with its own exception type
            raise errors.invalid(f"the prompt cannot be encoded: {e}", where, "invalid_prompt") from None
        params = self._params(req, len(ids))
        try:
            check_request(self.model, ids, self.cfg, params)
        except ValueError as e:
            raise errors.invalid(str(e), "prompt", "invalid_prompt") from None
        self._check_cache(len(ids), params)
        return ids, params

    def _check_size(self, size: int, where: str) -> None:
        """A text of more bytes than the context's tokens can stand for is refused unread."""
        if self.max_prompt_bytes is not None and size > self.max_prompt_bytes:
            raise errors.invalid(
                f"the prompt is {size:,} bytes of text, more than this server's context can hold: a prompt may have "
                f"{self.max_prompt_tokens:,} tokens and no token of this tokenizer stands for more than "
                f"{self.bytes_per_token} bytes ({self.max_prompt_bytes:,} bytes at most): shorten the prompt",
                where, "context_length_exceeded")

    def _check_cache(self, n_prompt: int, params: SamplingParams) -> None:
        """The KV cache grows to the longest request's room on every row: one request may not
        ask for more than `--max-batch` rows of it fit under the engine's ceiling (8 GiB)."""
        rows, cap = self.options.max_batch, row_capacity([[0] * n_prompt], self.cfg, params)
        need = self.engine.dec.bf.cache_bytes(rows, cap)
        if need > MAX_CACHE_BYTES:
            raise errors.invalid(f"prompt + max_tokens ({cap} positions) would need {need / 2**30:.1f} GiB of KV cache "
                                 f"for the server's {rows} rows, over the limit of {MAX_CACHE_BYTES / 2**30:.0f} GiB; "
                                 f"lower max_tokens", "max_tokens", "kv_cache_limit")

    def _params(self, req: GenerationRequest, n_prompt: int) -> SamplingParams:
        d, limit, cap = self.options.defaults.params, self.model.config.max_position_embeddings, self.options.max_context
        room = limit - n_prompt - lookahead(self.cfg)
        if cap is not None:
            room = min(room, cap - n_prompt)  # startup checked cap + lookahead <= limit
        want = req.max_tokens if req.max_tokens is not None else min(d.max_new_tokens, room)
        # the prompt alone fits: the answer's length is what is over, and the error names its field
        where = "messages" if req.kind == "chat" else "prompt"
        param = req.max_tokens_param if room >= 1 and req.max_tokens is not None else where
        if cap is not None and (want > room or room < 1):
            raise errors.invalid(
                f"this server's maximum context is {cap} tokens per request (prompt + max_tokens, --max-context); the "
                f"prompt has {n_prompt} and {want if req.max_tokens is not None else 'at least 1'} more were asked "
                f"for: shorten the prompt or lower max_tokens", param, "context_length_exceeded")
        if want > room or room < 1:
            raise errors.invalid(
                f"this model's maximum context length is {limit} tokens; the prompt has {n_prompt} and "
                f"{want if req.max_tokens is not None else 'at least 1'} more were asked for "
                f"(+{lookahead(self.cfg)} for drafting): shorten the prompt or lower max_tokens",
                param, "context_length_exceeded")
        return SamplingParams(max_new_tokens=want,
                              temperature=d.temperature if req.temperature is None else req.temperature,
                              top_k=d.top_k if req.top_k is None else req.top_k,
                              top_p=d.top_p if req.top_p is None else req.top_p)

    def open(self, req: GenerationRequest, ids: list[int], params: SamplingParams) -> Job:
        """Hand an admitted request (`admitting`) to the engine (503 if a drain began meanwhile)."""
        if self.draining:
            raise errors.shutting_down()
        job = Job(ids, params, req.stop, req.seed, asyncio.get_running_loop(), arrived=time.perf_counter(),
                  interval=self.options.stream_interval if req.stream else math.inf)
        self.active.add(job)
        self.engine.submit(job)
        return job

    async def next_event(self, job: Job):
        """The job's next event (`Delta`, then `Finished` or `Failed`); safe to cancel."""
        event = await job.events.get()
        if isinstance(event, (Finished, Failed)):
            job.ended = True
        return event

    def close(self, job: Job) -> None:
        """The request is over (answered, failed or abandoned); an unfinished one is cancelled."""
        if job in self.active:
            self.active.discard(job)
            if not job.ended:
                self.engine.cancel(job)

    # -- the server as a whole ---------------------------------------------------------------------
    async def drain(self, timeout: float | None = None) -> None:
        """Stop admitting (503); let what runs finish within `timeout` seconds; cut the rest (their
        clients get a 503 error) and give the responses a moment to go out."""
        self.draining = True
        loop = asyncio.get_running_loop()
        await self._until_idle(loop.time() + (self.options.shutdown_timeout if timeout is None else timeout))
        for job in list(self.active):
            self.engine.cancel(job, errors.cut_by_shutdown())
        await self._until_idle(loop.time() + 5.0)

    async def _until_idle(self, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self.active and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def health(self) -> dict:
        e = self.engine
        return {"status": "draining" if self.draining else "ok", "model": self.options.model_id,
                "running": e.running, "waiting": e.waiting, "admitted": len(self.active), "capacity": self.capacity,
                "finished": e.counts["finished"], "cancelled": e.counts["cancelled"], "failed": e.counts["failed"]}
