"""How much of a joining prompt a turn prefills while rows run (the decoder's chunked prefill).

A chunk stalls the running rows for its time. In a forward of its own it pays a whole pass over
the weights however few its tokens; where it rides in the round's forward (the exact formats,
`BatchForward.joins`) only what its tokens add. Plan "auto" sizes it from what rounds and chunks are measured
to take (`pick_chunk`); a fixed mode takes PREFILL_CHUNK tokens.

Example: AR rounds of the running rows take 30 ms and a chunk's forward is priced 10 ms + 1 ms a
token, chunks having taken 1.5x their price: a 2,000-token prompt goes in chunks of 10 tokens
(1.5 x 20 ms <= 30 ms) until what is left costs at most 4 rounds (1.5 x (10 + 70) ms = 120 ms),
then the last 70 in one.

A chunk that cannot ride (its own forward: fp32, and w4a8, whose rounds run all their layers in
one C call) pays a whole pass over the weights however few its tokens, so it is made big enough
to be worth one (PREFILL_OWN_ROUNDS AR rounds) and spaced (`chunk_due`): the rows run twice its
time before the next one (a few tokens' chunk every turn had stretched each running row's gap
several-fold and delayed a long prompt's first token for seconds).

Spacing is for a long prompt's pieces: a chunk that prefills short prompts whole (each from its
first token) runs at once, as many of them as fit in one such forward (`whole_prompts`), since a
free row that waits for its prompt decodes nothing and the chunk's time is paid whenever it runs.
Spacing them too left rows empty several times as long as a fixed mode's immediate joins and
cost `auto` its floor.

A burst is another matter: while more prompts wait for their first token than rows run, every
waiting prompt is prefilled in the turn (`prefill_first`): each of them gains a whole row's
tokens from joining, each running row loses one gap. Prompts that enter together take rows
shortest first, and are prefilled in forwards over groups of rows of similar length
(`prefill_groups`): a forward pads every row to its longest.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_CHUNK = 256  # prompt tokens a turn prefills while rows run, when no cost model picks it
PREFILL_FLOOR = 1  # the least a cost model's chunk may be
PREFILL_ROUNDS = 1.0  # a picked chunk's forward costs at most this many AR rounds of the live rows: a running
# row then waits at most about twice its usual gap between tokens while a long prompt joins
PREFILL_WHOLE_ROUNDS = 4.0  # what is left of a prompt goes in one chunk when it costs at most this many: a
# short prompt joins in one forward (a chunk pays a whole forward's weight reads however few its tokens)
PREFILL_OWN_ROUNDS = 12.0  # ... except a chunk in a forward of its own (it cannot ride: fp32, w4a8's one-call rounds),
# which pays a whole pass over the weights however few its tokens (a 1-token chunk already costs about an AR round
# of 4 rows): it may cost this many, and such chunks come spaced (PREFILL_SHARE)
PREFILL_SHARE = 1 / 3  # own-forward chunks take at most this share of the time while rows run: the next one waits
# until the rows have run (1 - share) / share times the last one's time. At 12 rounds a chunk, about 1 turn in 25
# has one: the running rows' p95 gap stays their own, their slowest ~13 rounds
CHUNK_EMA = 0.5  # weight of the latest chunk's measured / predicted time
SHARED_MIN = 16  # prompts starting with this many tokens alike or more prefill their common prefix once
GROUP_FIXED_TOKENS = 8  # without a cost model: a forward's fixed cost (its pass over the weights) in query tokens


def prefill_first(prefilling: int, live: int) -> bool:
    """Whether a turn prefills all `prefilling` prompts at once (a burst: they outnumber the `live`
    rows) rather than a chunk: a prompt without its first token gains a whole row's decoding from
    joining, a running row loses one gap. A long prompt joining a running batch (1 <= live) keeps
    to chunks, so that its rows' inter-token latency holds."""
    return prefilling > live


def prefill_groups(lefts: list[int], price) -> list[tuple[int, int]]:
    """Consecutive groups [a, b) of rows whose prefill forwards cost least in all: rows with
    `lefts[i]` prompt tokens to go (shortest first, as they take rows), a forward over rows a..b-1
    costing price(b - a, max(lefts[a:b])) (every row padded to its longest). Dynamic programming
    over the split points; `price(rows, width)` is a cost model's f(rows, width), or tokens plus a
    forward's fixed cost (`token_price`).

    Example: lefts [10, 12, 40, 44] at 8 tokens a forward plus 1 a token: one forward pads to
    4 x 44 + 8 = 184, two forwards [10, 12] and [40, 44] cost 2 x 12 + 8 + 2 x 44 + 8 = 128."""
    n = len(lefts)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for b in range(1, n + 1):
        for a in range(b):
            c = best[a] + price(b - a, max(lefts[a:b]))
            if c < best[b]:
                best[b], cut[b] = c, a
    groups, b = [], n
    while b:
        groups.append((cut[b], b))
        b = cut[b]
    return groups[::-1]


def token_price(rows: int, width: int) -> float:
    """A forward's price without a cost model: its query tokens plus GROUP_FIXED_TOKENS."""
    return rows * width + GROUP_FIXED_TOKENS


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


def whole_prompts(lefts: list[int], price, budget: float) -> int:
    """How many of the waiting prompts (`lefts`: their tokens left, in the order they take rows)
    one forward prefills whole within `budget`: the largest k with price(k x max(lefts[:k])) <=
    budget (a forward pads every row to its longest), 0 when not even the first fits.

    Example: lefts [30, 40, 200] at 1 ms a token and a 100 ms budget: 2 (2 x 40 = 80 tokens;
    3 x 200 = 600 do not fit)."""
    k, widest = 0, 0
    for n in lefts:
        widest = max(widest, n)
        if price((k + 1) * widest) > budget:
            break
        k += 1
    return k


def chunk_due(rows_seconds: float, chunk_seconds: float, share: float = PREFILL_SHARE) -> bool:
    """Whether an own-forward chunk may run: the rows have run `rows_seconds` since the last one,
    which took `chunk_seconds`, and chunks take at most `share` of the time.

    Example: a chunk took 80 ms; at share 1/3 the next waits for 160 ms of rounds."""
    return rows_seconds >= chunk_seconds * (1.0 - share) / share


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def kept_prefixes(retained: dict, start: int, prompts: list[list[int]]) -> list[int]:
    """The slots each of rows start.. keeps for the prompt entering it (`BatchKVCache.claim`): what
    the row retained of a finished sequence (`retained`: row -> tokens), where the prompt starts
    with SHARED_MIN or more of those tokens, all but the prompt's last token at most; else 0."""
    keep = []
    for i, p in enumerate(prompts):
        held = retained.get(start + i)
        c = common_prefix(held, p) if held is not None else 0
        keep.append(min(c, len(p) - 1) if c >= SHARED_MIN else 0)
    return keep


def shared_prefixes(prompts: list, donors: list, least: int = SHARED_MIN) -> list[tuple]:
    """Which rows about to be prefilled can copy a prefix's K/V instead of running it: `prompts[i]`
    the prompt of row i (None: a row that holds part of its prompt already), `donors` `(row,
    tokens)` of rows whose cache holds `tokens`. Rows whose prompts start with the same `least`
    tokens form a group; their common prefix (each keeps at least its last token to run) comes
    from a donor holding `least` or more of it (then as much as it holds), else from the group's
    first row, which prefills it once. Returns `(donor, src, n, rows)`: copy the first n slots of
    src into each of `rows` (indices into `prompts`); src is a donor's row (donor True) or an index
    into `prompts` whose row prefills its first n tokens before the copies (donor False).

    Example: prompts [A+x, A+y, B] with A 20 tokens, no donors: [(False, 0, 20, [1])]; with a donor
    (7, A+z): [(True, 7, 20, [0, 1])]."""
    groups: dict = {}
    for i, p in enumerate(prompts):
        if p is not None and len(p) > least:
            groups.setdefault(tuple(p[:least]), []).append(i)
    plan = []
    for rows in groups.values():
        first = prompts[rows[0]]
        n = min(min(len(prompts[i]) for i in rows) - 1, *(common_prefix(first, prompts[i]) for i in rows))
        held, src = max(((common_prefix(first, t), r) for r, t in donors), default=(0, None))
        if held >= least:
            plan.append((True, src, min(n, held), rows))
        elif len(rows) > 1 and n >= least:
            plan.append((False, rows[0], n, rows[1:]))
    return plan
