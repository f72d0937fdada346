"""The engine thread: the one owner of the `Decoder`, running turns while requests come and go.

Continuous batching is the decoder's (`Decoder.add` queues a prompt; it takes a free cache row
at the next turn, `--max-batch` rows at most); this thread only feeds it. Between two turns it
takes what the asyncio side handed over (new jobs, cancellations) under one lock, and when
nothing runs or waits it sleeps on that lock's condition: an idle server burns no CPU. Each row's
text is made here (`streaming.RowText`: incremental detokenisation, stop strings held back or
cut; a row that hits a stop string is cancelled at once, freeing its row), and handed to the
request's asyncio queue with `loop.call_soon_threadsafe`, the only thread-safe door into a loop.
The first token of a request is sent as soon as its prefill yields it, before the round.

Later text is handed over at most once per `Job.interval` (`--stream-interval-ms`; a whole,
not streamed, answer: once, at its end), what comes sooner is held and joins the next delta. Each
hand-over is an event through the loop, an SSE line, a `send` on the socket and a read and parse
in the client; on 2 cores every one of those runs beside the forward and slows it (per event,
a measurable share of a token's time), while a human reader or a terminal sees no difference below a screen's frame.

Sequences are dropped from the decoder (`Decoder.forget`) once their row has left, so a server
that runs for weeks keeps no per-request data.

`python -m selfspec serve` runs the engine on the process's main thread (`run_foreground`) and
the HTTP event loop in a thread of its own: torch's CPU kernels fork and join their OpenMP team
about twice as slowly from any other thread (a small bf16 matmul and a whole AR step of the
default model alike), and a decode step is
hundreds of such small ops. `start()` (a background thread) is for embedding and tests.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field


from selfspec.engine.request.sequence import SamplingParams
from selfspec.serving.openai_api.errors import ApiError, cut_by_shutdown, internal, invalid
from selfspec.streaming import RowResult, RowText

log = logging.getLogger("selfspec.serve")

GATHER_WINDOW = 0.01  # seconds an idle engine waits after a request for the next one (--burst-window-ms)
GATHER_ROUNDS = 10  # the first request of a burst waits at most this many windows
STREAM_INTERVAL = 0.01  # seconds between a stream's deltas at least (--stream-interval-ms); text in between is held


@dataclass(frozen=True)
class Delta:
    """Text (maybe empty while a stop string is undecided) and the token ids committed with it."""

    text: str
    ids: list[int]


@dataclass(frozen=True)
class Finished:
    reason: str  # OpenAI's: "stop" (eos or a stop string) or "length"
    prompt_tokens: int
    token_ids: list[int]  # the answer's ids (cut after a stop string)
    stats: dict  # Stats.as_dict() and the decoding plan


@dataclass(frozen=True)
class Failed:
    error: ApiError


@dataclass(eq=False)
class Job:
    """One request on its way through the engine. The asyncio side owns `events`, `arrived` and
    `ended`; the fields after them belong to the engine thread."""

    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    seed: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = 0.0  # time.perf_counter() when it was admitted
    interval: float = 0.0  # seconds between two deltas at least (math.inf: a whole answer, text at its end)
    ended: bool = False  # its final event was read
    seq: object = None  # engine.sequence.Sequence once added
    text: RowText | None = None
    result: RowResult | None = None
    sent: int = 0  # ids already handed over
    held: list = field(default_factory=list)  # text not yet handed over (`interval`)
    posted: float = 0.0  # time.perf_counter() of the latest delta (0: none yet)
    closed: bool = False  # its final event was posted (or nobody listens any more)

    def post(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:
            pass  # the loop has closed: nobody reads this request any more


class Engine:
    """Runs `make_decoder()`'s decoder in a thread of its own; `submit` / `cancel` from any thread."""

    def __init__(self, make_decoder, tokenizer, *, window: float = GATHER_WINDOW):
        self._make = make_decoder
        self.window = window
        self.dec = make_decoder()
        self.tok = tokenizer
        self._cond = threading.Condition()
        self._inbox: list[Job] = []
        self._cancels: list[tuple[Job, ApiError | None]] = []
        self._stopping = False
        self._reading = 0  # requests the asyncio side is parsing, not yet submitted (`reading`)
        self._jobs: dict[int, Job] = {}  # decoder row id (Sequence.index) -> its job
        self.counts: Counter = Counter()  # finished / cancelled / failed, for /health
        self._thread = threading.Thread(target=self._run, name="selfspec-engine", daemon=True)
        self.foreground = False  # `run_foreground` owns the loop: `start()` does nothing

    # -- any thread --------------------------------------------------------------------------------
    def start(self) -> None:
        """Run the engine in a background thread (a no-op once `run_foreground` owns it)."""
        if not self.foreground:
            self._thread.start()

    def run_foreground(self) -> None:
        """Run the engine on the calling thread (the main one, see the module's docstring) until
        `stop()`; signal handlers of that thread still run while it waits for work."""
        self.foreground = True
        self._run()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._inbox.append(job)
            self._cond.notify()

    @contextmanager
    def reading(self):
        """Around a request's parsing and submission: an idle engine woken by another request
        waits for this one too (`_gather`)."""
        with self._cond:
            self._reading += 1
        try:
            yield
        finally:
            with self._cond:
                self._reading -= 1
                self._cond.notify()

    def cancel(self, job: Job, error: ApiError | None = None) -> None:
        """Stop `job` at the next turn (its row is freed); `error` is posted to it, if given."""
        with self._cond:
            self._cancels.append((job, error))
            self._cond.notify()

    def stop(self, timeout: float | None = None) -> bool:
        """End the thread after the current turn; unfinished jobs get a 503. True once it ended."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def running(self) -> int:
        return len(self.dec.scheduler.live)

    @property
    def waiting(self) -> int:
        """Requests without their first token yet: queued, or prefilled a chunk per turn."""
        sched = self.dec.scheduler
        return len(sched.waiting) + len(getattr(sched, "prefilling", ())) + len(self._inbox)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            new, cancels, stopping = self._wait()
            if stopping:
                self._shutdown(new)
                return
            try:
                self._cycle(new, cancels)
            except Exception:  # a bug, not bad input (that is refused before it gets here)
                log.exception("the decoder failed; its requests are dropped and a fresh decoder takes over")
                self._reset(new)

    def _wait(self):
        """Sleep until there is work; then take it (new jobs, cancellations, whether to stop)."""
        with self._cond:
            while not (self._inbox or self._cancels or self._stopping or self.dec.scheduler.busy):
                self._cond.wait()
            if self._inbox and not self.dec.scheduler.busy and self.window > 0:
                self._gather()
            new, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
            return new, cancels, self._stopping

    def _gather(self) -> None:
        """An idle engine woken by a request waits while requests keep coming (each within
        `window` seconds of the last, or still being read), GATHER_ROUNDS windows at most, so that
        a burst is prefilled in one turn. Without it the first request of a burst is prefilled
        alone and those that arrive meanwhile wait for that turn, then for their own: clients
        started at once reach this engine spread over tens of ms, and one arriving during the
        burst's prefill waited for it too (the window lowers the p95 of first tokens at the price
        of the median: `docs/serving.md`). A lone request pays one window. Called
        with the lock held; waiting releases it."""
        now = time.perf_counter()
        end, quiet = now + GATHER_ROUNDS * self.window, now + self.window
        seen = len(self._inbox)
        while not self._stopping and now < end and (now < quiet or self._reading):
            self._cond.wait((end if self._reading else min(end, quiet)) - now)
            now = time.perf_counter()
            if len(self._inbox) > seen:
                seen, quiet = len(self._inbox), now + self.window

    def _cycle(self, new: list[Job], cancels: list) -> None:
        for job in new:
            self._admit(job)
        for job, error in cancels:
            self._cancel(job, error)
        if self.dec.scheduler.busy:
            for row, chunk in self.dec.turn():
                job = self._jobs.get(row)
                if job is not None:
                    self._deliver(job, chunk)
        self._settle()

    def _admit(self, job: Job) -> None:
        try:
            job.seq = self.dec.add(job.prompt_ids, params=job.params, seed=job.seed)
        except ValueError as e:  # checked before, so rare: the decoder's own word on the prompt
            self._close(job, Failed(invalid(str(e), code="invalid_prompt")), "failed")
            return
        job.result = RowResult(job.prompt_ids, stats=job.seq.stats)
        job.text = RowText(job.result, self.tok, list(job.stops), self.dec.eos, job.params.max_new_tokens)
        self._jobs[job.seq.index] = job

    def _cancel(self, job: Job, error: ApiError | None) -> None:
        if job.closed:
            return  # finished before the cancellation arrived
        if job.seq is not None and not job.seq.done:
            self.dec.cancel(job.seq)
        self._close(job, None if error is None else Failed(error), "cancelled")

    def _deliver(self, job: Job, chunk: list[int]) -> None:
        if job.closed:
            return  # cancelled or cut by a stop string this turn: its row leaves at the next one
        text = job.text.push(chunk)
        if job.result.finish_reason == "stop_string":
            self.dec.cancel(job.seq)
        self._send(job, text)
        if job.result.finish_reason is not None:
            self._finish(job)

    def _send(self, job: Job, text: str, *, last: bool = False) -> None:
        """Hand `text` (and the ids committed with it) over now, or hold it until `job.interval`
        has passed since the previous delta: the first delta and the `last` go at once."""
        if text:
            job.held.append(text)
        now = time.perf_counter()
        if not (last or job.posted == 0.0 or now - job.posted >= job.interval):
            return
        ids = job.result.token_ids[job.sent:]
        job.sent = max(job.sent, len(job.result.token_ids))
        text, job.held = "".join(job.held), []
        if text or ids:
            job.post(Delta(text, list(ids)))
            job.posted = now

    def _finish(self, job: Job) -> None:
        self._send(job, job.text.finish(), last=True)  # and what a stop string held back, when the row ended otherwise
        res, cfg = job.result, self.dec.cfg
        reason = "length" if res.finish_reason == "length" else "stop"
        stats = {"plan": cfg.plan, "mode": cfg.mode, **job.seq.stats.as_dict()}
        self._close(job, Finished(reason, len(job.prompt_ids), list(res.token_ids), stats), "finished")

    def _close(self, job: Job, event, count: str) -> None:
        job.closed = True
        self.counts[count] += 1
        if event is not None:
            job.post(event)

    def _settle(self) -> None:
        """Jobs whose rows ended get their final event; those whose rows left are forgotten."""
        live = set(map(id, self.dec.scheduler.live))
        for row, job in list(self._jobs.items()):
            if not job.seq.done:
                continue
            if not job.closed:
                self._finish(job)
            if id(job.seq) not in live:
                self.dec.forget(job.seq)
                del self._jobs[row]

    def _shutdown(self, new: list[Job]) -> None:
        for job in new + list(self._jobs.values()):
            if job.seq is not None and not job.seq.done:
                self.dec.cancel(job.seq)
            if not job.closed:
                self._close(job, Failed(cut_by_shutdown()), "cancelled")
        self._jobs.clear()
        self.dec.close()

    def _reset(self, new: list[Job]) -> None:
        for job in new + list(self._jobs.values()):
            if not job.closed:
                self._close(job, Failed(internal("the decoder failed on this batch; the request was dropped")),
                            "failed")
        self._jobs.clear()
        self.dec = self._make()
