"""Which sequences run (nano-vllm's `Scheduler`): a queue of waiting ones, the ones being
prefilled in chunks and the live ones; live sequence i in cache row i, prefilling sequence j in
cache row len(live) + j.

Free cache rows take waiting sequences (`admit`, into rows `len(live) + len(prefilling)..`).
With nothing running the prefill runs them together at once and they join the live ones
(`place`); while rows run, they are prefilled a chunk per turn (`prefilling`) and join the live
ones when their last chunk is in (`join`, in admission order). After every round the finished or
cancelled ones leave (`retire`): the last live rows move into the freed cache rows and the
prefilling rows move down behind them (`cache.BatchKVCache.pack`), so the live sequences always
hold rows 0..R-1 and a round's forward runs over one contiguous block of rows.

The scheduler owns the prefill (`prefill.Prefill`, `scheduler.prefill`): which waiting prompts
enter, how much of them a turn prefills, chunk pacing and prefix reuse; it runs the prefill
forwards on the stepper it is given, and the rows that finish leave their K/V to it (`retain`).
Rounds are the stepper's.
"""

from __future__ import annotations

from collections import deque

from selfspec.engine.schedule.prefill import Prefill


class Scheduler:
    """Waiting and live sequences for a cache of `max_rows` rows, and their prefill on `stepper`'s
    forward and cache (`prefill_chunk`, `prefill_group`: `prefill.Prefill`'s `chunk` and `group`)."""

    def __init__(self, max_rows: int, *, stepper, prefill_chunk: int | None = None, prefill_group: bool = False):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows = max_rows
        self.waiting: deque = deque()
        self.live: list = []  # live[i] holds cache row i
        self.prefilling: list = []  # prefilling[j] holds cache row len(live) + j, its prompt partly in
        self.prefill = Prefill(self, stepper, chunk=prefill_chunk, group=prefill_group)

    def add(self, seq) -> None:
        self.waiting.append(seq)

    @property
    def draining(self) -> bool:
        """No sequence waits for a row or for the rest of its prefill: the batch now ends with its
        slowest row."""
        return not (self.waiting or self.prefilling)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.live or self.prefilling)

    def admit(self) -> tuple[list, int]:
        """The waiting sequences that fit into the free rows, in order, and the first row they
        take (they hold rows slot, slot + 1, ... until `place` or `join` runs)."""
        slot = len(self.live) + len(self.prefilling)
        entering = [self.waiting.popleft() for _ in range(min(self.max_rows - slot, len(self.waiting)))]
        return entering, slot

    def place(self, entering: list, cache) -> None:
        """The entering sequences (prefilled into rows len(live)..) join the live ones, except those
        that finished at their first token (their rows are reused)."""
        self.prefill.retain(entering, len(self.live), len(self.live) + len(entering))
        self.live = cache.compact(self.live + [None if s.done else s for s in entering])

    def start_prefill(self, entering: list) -> None:
        """The entering sequences (in rows len(live) + len(prefilling)..) are prefilled in chunks."""
        self.prefilling += entering

    def join(self, n: int, cache) -> list:
        """The first `n` prefilling sequences (their prompts now fully in) join the live ones,
        except those that finished at their first token; the rest stay behind them. Returns the
        `n` sequences."""
        ready, rest = self.prefilling[:n], self.prefilling[n:]
        self.prefill.retain(ready, len(self.live), len(self.live) + len(self.prefilling))
        self.live, self.prefilling = cache.pack(self.live + [None if s.done else s for s in ready], rest)
        return ready

    def retire(self, cache) -> list:
        """Finished and cancelled sequences leave; their rows are filled by moving the last live
        rows in. Returns the sequences that left."""
        rows = self.live + self.prefilling
        gone = [s for s in rows if s.done]
        if gone:
            self.prefill.retain(rows, 0, len(rows))  # before the moves below overwrite their rows
            self.live, self.prefilling = cache.pack([None if s.done else s for s in self.live],
                                                    [None if s.done else s for s in self.prefilling])
        return gone

    def cancel(self, seq) -> bool:
        """Stop `seq` at the next round: a waiting one leaves the queue now, a live or prefilling
        one is marked done (its row is freed by the next `retire`). Returns whether it was still
        running."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        elif (seq not in self.live and seq not in self.prefilling) or seq.done:
            return False
        seq.done = seq.cancelled = True
        seq.finish()
        return True

