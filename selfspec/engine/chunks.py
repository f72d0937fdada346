"""How much of a joining prompt a turn prefills while rows run (the decoder's chunked prefill).

A chunk stalls the running rows for its time. In a forward of its own it pays a whole pass over
the weights however few its tokens; where it rides in the round's forward (the exact formats,
`BatchForward.joins`) only what its tokens add. Plan "auto" sizes it from what rounds and chunks are measured
to take (`pick_chunk`); a fixed mode takes PREFILL_CHUNK tokens.

Example: AR rounds of the running rows take 30 ms and a chunk's forward is priced 10 ms + 1 ms a
token, chunks having taken 1.5x their price: a 2,000-token prompt goes in chunks of 10 tokens
(1.5 x 20 ms <= 30 ms) until what is left costs at most 4 rounds (1.5 x (10 + 70) ms = 120 ms),
then the last 70 in one.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_CHUNK = 256  # prompt tokens a turn prefills while rows run, when no cost model picks it
PREFILL_FLOOR = 1  # the least a cost model's chunk may be
PREFILL_ROUNDS = 1.0  # a picked chunk's forward costs at most this many AR rounds of the live rows: a running
# row then waits at most about twice its usual gap between tokens while a long prompt joins
PREFILL_WHOLE_ROUNDS = 4.0  # what is left of a prompt goes in one chunk when it costs at most this many: a
# short prompt joins in one forward (a chunk pays a whole forward's weight reads however few its tokens)
CHUNK_EMA = 0.5  # weight of the latest chunk's measured / predicted time


@dataclass(frozen=True)
class ChunkRun:
    """A chunk's forward as run: `rows` x `width` query tokens over `cached` ones (the longest
    row's), `seconds` of model time. A chunk that rode in a round's forward has `base`, the
    round's query rows, and `round_seconds`, the round's own predicted model time: the chunk's
    part is what the forward took beyond it."""

    rows: int
    width: int
    cached: int
    seconds: float
    base: int = 0
    round_seconds: float = 0.0

    def price(self, cost) -> float:
        return chunk_price(cost, self.rows, self.width, self.cached, self.base)


def chunk_price(cost, rows: int, width: int, cached: int, base: int = 0) -> float:
    """The cost model's price of a chunk of `rows` x `width` tokens over `cached` ones: its own
    forward's, or, riding with `base` query rows in their forward, what it adds to them
    (cost(1, base + its tokens) - cost(1, base))."""
    if not base:
        return cost(rows, width, cached)
    return cost(1, base + rows * width, cached) - cost(1, base, cached)


class ChunkScale:
    """What chunks took over the cost model's price, smoothed: a cost model's cache axis ends at
    1,024 tokens, and a long prompt's chunks run past it."""

    def __init__(self):
        self.ratio: float | None = None

    def observe(self, cost, run: ChunkRun) -> None:
        """A chunk ran (`run`); `cost` priced it. A riding chunk's time is its forward's beyond
        the round's prediction (at least a tenth of its price: a fast round is not a free chunk)."""
        price = max(run.price(cost), 1e-9)
        r = max(run.seconds - run.round_seconds, 0.1 * price) / price
        self.ratio = r if self.ratio is None else self.ratio + CHUNK_EMA * (r - self.ratio)

    @property
    def factor(self) -> float:
        return 1.0 if self.ratio is None else self.ratio


def pick_chunk(cost, rows: int, cache: int, cached: int, most: int, *, rounds: float = PREFILL_ROUNDS,
               floor: int = PREFILL_FLOOR, round_seconds: float | None = None, scale: float = 1.0,
               whole: float = PREFILL_WHOLE_ROUNDS, base: int = 0) -> int:
    """`most` (all that is left) when its price is at most `whole` AR rounds of `rows` live rows
    at `cache` tokens (`round_seconds`, else cost(rows, 1, cache)); else the largest prefill
    chunk c <= `most` whose price is at most `rounds` of them: a long prompt's chunks stall the
    live rows for at most `rounds` AR rounds each, a short prompt joins at once. At least
    `floor`. A chunk's price: scale x cost(1, c, cached) in a forward of its own; with `base`
    query rows it joins in the same forward, what it adds to them, scale x (cost(1, base + c,
    cached) - cost(1, base, cached)). `cost`: a `cost.CostModel`; `scale`: measured over
    predicted chunk time. Assumes the cost grows with the width (a binary search)."""
    most = max(1, int(most))
    ar = cost(rows, 1, cache) if round_seconds is None else round_seconds
    budget = rounds * ar
    def price(c: int) -> float:
        return scale * chunk_price(cost, 1, c, cached, base)

    if price(most) <= max(budget, whole * ar):
        return most
    lo, hi = 0, most  # price(lo) <= budget (or lo = 0), price(hi) > budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if price(mid) <= budget else (lo, mid)
    return max(lo, min(floor, most))
