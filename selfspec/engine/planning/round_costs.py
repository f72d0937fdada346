"""What the planner weighs, priced from the one cost model: a round (`RoundCosts`, `planner.costs`), a
prompt chunk (`chunk_price`, `pick_chunk`) and a bet against the floor (`Ledger`, `planner.ledger`).

A round's cost: the device's cost model f(rows, width, cache) (`cost.CostModel`, memoised per 32
cached tokens) at the cheapest width the round can be padded to, times a scale per kind of round
measured from the rounds that ran, plus a measured overhead per row and a measured time per target
token drawn. AR rounds that a forecast preceded keep their own scale and overhead ("ar-forecast"):
what they take beyond a bare AR round is the forecast's drag on the forward (`forecast_drag`), which
the ledger charges to speculation.

Only AR's scale is absolute (the machine's speed now against the cost model's); every other kind
keeps its scale relative to AR's at the time it ran. The machine's speed drifts within a minute,
so two absolute scales taken at different times would compare the drift, not the kinds. Unlike the
overheads, the relative scales do not drift back towards AR's while a kind does not run: measured
beside AR, lookup rounds really take more than the cost model's prediction, and forgetting it
between bets lost time.

AR's scale is measured by bare AR rounds only, and a streak of bets runs none: the planner then runs
one every `planner.REFRESH_AR` rounds, weighted REFRESH_EMA, again at once while one moves the scale by
more than REFRESH_MOVE, and the kinds measured against the stale scale meanwhile are re-based on the
new one (a machine faster by then had priced wrong chains as wins).

Example (times in any unit): f(1, 1, 64) = 3.0 from the cost model and AR rounds measured at 3.3
of model time give AR the scale 1.1; a lookup chain of 3 (width 4, f = 4.5) not yet run is priced
with AR's scale, 4.95, plus its overhead and four draws a row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from selfspec.engine.round.rounds import AR, Option, Seen

EMA = 0.1  # weight of a new observation in the smoothed time scales
REFRESH_MOVE = 0.1  # a refresh that moved AR's scale by more than this share is followed by another at once
REFRESH_EMA = 0.5  # weight of AR's time measured after a streak of bets (`planner.REFRESH_AR`): one sample in dozens
# of rounds, when the machine's speed may have moved a lot; the sample is clipped to within 2x of the scale, so
# one stall moves it by half at most (and the follow-up refresh measures again)
FORECAST_AR = "ar-forecast"  # the scale and overhead of AR rounds that a forecast preceded (`observe`)

EPS = 0.02  # share of the time speculation may lose beyond what it has won (half of it left code prompts
# slower at T = 0: fewer of their chains bet on)
CREDIT = 1.0  # AR rounds a new planner may lose before anything was won: a first cheap bet
CAP = 8.0  # funds never exceed this many AR rounds: when a text stops being predictable, old wins pay
# for at most this much of the losing streak
START_MIN = 0.0  # the least funds a generation starts with (`Planner.begin`): no debt carried into it. In a
# policy A/B (one model, one process, bench prompts) -1 and no floor were within noise of it; in a
# bench, one probe lost in the first answer had left every later answer at T = 0 nearly without a bet
PLAN_EMA = 0.2  # weight of a new forecast's time in its running estimate
PAUSE = 4.0  # a round's time beyond this many times its prediction is a stall it did not cause
SHADOW_CAP = 0.5  # AR rounds of hindsight wins that may fund lookup bets (halved by each such bet that lost)
PLAN_FIRST = 0.1  # AR rounds a forecast is taken to cost before any was timed (~0.02-0.05 on a 2-core CPU):
# at a whole AR round, a stall in the first forecast priced every later one at 0.8 AR rounds


class RoundCosts:
    """The planner's time model: `cost` a `cost.CostModel`; rounds of a two-pass layout add a
    draft pass of `block_length`; no round is padded past `max_width`."""

    def __init__(self, cost, *, block_length: int, max_width: int):
        self.cost, self.block_length, self.max_width = cost, block_length, max_width
        self._memo: dict[tuple, object] = {}  # f and padded widths, per rows, width and 32 cached tokens
        self.overhead: dict[str, float] = {}  # seconds per row-round outside the model, by kind of round
        self.draw = 0.0  # seconds per target token drawn (per verified node; sampled ones cost ~25x argmax's)
        self._draws: list[float] = []  # the last 9 rounds' time per draw (`draw`: their median)
        self._recent: dict[str, list[float]] = {}
        self.scale: dict[str, float] = {}  # "ar": measured / predicted model time of bare AR rounds
        self.relative: dict[str, float] = {}  # other kinds: their measured / predicted over AR's scale then
        self.since_ar: set[str] = set()  # kinds whose relative scale was measured since AR's latest sample
        self.refresh_moved = 0.0  # how far the latest refresh moved AR's scale (a share): another one follows
        self.first_scale = 1.0  # before any bare AR round: the latest round's measured / predicted model time

    def fork(self) -> "RoundCosts":
        """A copy that writes only its own tables (`planner.Planner.fork`)."""
        new = copy.copy(self)
        for name in ("overhead", "_recent", "_draws", "scale", "relative", "since_ar"):
            setattr(new, name, copy.deepcopy(getattr(self, name)))
        new._memo = dict(self._memo)  # floats and (width, float) tuples: nothing in it changes in place
        return new

    def seconds(self, o: Option, rows: int, cache: int) -> tuple[int, float]:
        """(padded width, predicted seconds) of a round of `o` over `rows` rows: the cost model at
        the cheapest width from o's up to twice it (and `max_width`) among the measured ones (a
        device may run a wider forward faster), times the kind's scale, plus its overhead and the
        target's draws (one per verified node and root: a sampled draw on a CPU is a sizeable share
        of an AR round, which a chain pays per node where argmax would not)."""
        width, s = self._padded(rows, o.width, cache)
        if o.draft_pass:
            s += self._f(rows, self.block_length, cache)
        fam = o.family
        return width, s * self._scale(fam) + (self._overhead(fam) + self.draw * (o.nodes + 1)) * rows

    def least_seconds(self, family: str, rows: int, nodes: int, cache: int) -> float:
        """A lower bound of `seconds` for every chain of this kind of 1 .. `nodes` nodes: the
        least padded model time among them (memoised), at least two draws a row."""
        key = ("least", rows, nodes, cache >> 5)
        f = self._memo.get(key)
        if f is None:
            f = self._memo[key] = min(self._padded(rows, k + 1, cache)[1] for k in range(1, max(1, nodes) + 1))
        return f * self._scale(family) + (self._overhead(family) + 2 * self.draw) * rows

    def model_seconds(self, family: str, rows: int, width: int, cache: int) -> float:
        """Predicted model time of one forward of `rows` x `width` over `cache` tokens in a round
        of this kind (the cost model times the kind's measured scale)."""
        return self._f(rows, width, cache) * self._scale(family)

    def forecast_drag(self, rows: int, cache: int) -> float:
        """Seconds an AR round that a forecast preceded takes beyond a bare one, outside the
        forecast itself: its forward and the rest of its round, as measured (a forward runs slower
        right after a forecast's Python, which the ledger did not see while it priced such a round
        as AR's forward plus the forecast)."""
        if FORECAST_AR not in self.relative or "ar" not in self.scale:
            return 0.0
        model = (self.relative[FORECAST_AR] - 1.0) * self.scale["ar"] * self._f(rows, 1, cache)
        rest = (self.overhead.get(FORECAST_AR, 0.0) - self.overhead.get("ar", 0.0)) * rows
        return max(0.0, model + rest)

    def _scale(self, family: str) -> float:
        """Measured / predicted model time for a kind of round: AR's scale (before any AR round,
        the latest of any kind's: the first rounds are judged on the same clock) times the kind's
        relative one (1 until the kind has run beside AR)."""
        ar = self.scale.get("ar", self.first_scale)
        return ar if family == "ar" else ar * self.relative.get(family, 1.0)

    def _overhead(self, family: str) -> float:
        """Seconds per row outside the model and the planner for a kind of round (as `_scale`)."""
        return _per_kind(self.overhead, family, 0.0)

    def _padded(self, rows: int, width: int, cache: int) -> tuple[int, float]:
        """The cheapest width from `width` up to twice it (and `max_width`) and its f, memoised
        like `_f` (the planner asks it for every option of every round)."""
        key = ("pad", rows, width, cache >> 5)
        v = self._memo.get(key)
        if v is None:
            best = (width, self._f(rows, width, cache))
            for w in self.cost.widths:
                if width < w <= min(2 * width, self.max_width) and self._f(rows, w, cache) < best[1]:
                    best = (w, self._f(rows, w, cache))
            v = self._memo[key] = best
        return v

    def _f(self, rows: int, width: int, cache: int) -> float:
        """The cost model's f(rows, width, cache), memoised per 32 cached tokens (asked every round)."""
        key = (rows, width, cache >> 5)
        v = self._memo.get(key)
        if v is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            v = self._memo[key] = self.cost(rows, width, cache)
        return v

    def observe(self, seen: "Seen") -> None:
        """The round's model time against the prediction (a scale per kind of round: a cost
        model taken under other load can be off in its 1 -> 2 token step, which only rounds of
        both kinds show) and its overhead per row (a median of the last 9, so first-call costs
        do not linger)."""
        option, R, fam = seen.option, seen.rows, seen.option.family
        if option is AR and not seen.bare:  # AR's forward, but after a forecast: its own scale (`forecast_drag`)
            fam = FORECAST_AR
        predicted = self._f(R, seen.width, seen.cache_len)
        if option.draft_pass:
            predicted += self._f(R, self.block_length, seen.cache_len)
        if seen.model_seconds > 0:
            ratio = seen.model_seconds / predicted
            if fam == "ar" and seen.refresh and "ar" in self.scale:
                # after a streak of bets: the kinds measured meanwhile were measured against a stale AR speed,
                # re-based on the new one (a kind's own cost is relative to AR's at the same moment)
                old = self.scale["ar"]
                _smooth(self.scale, "ar", min(max(ratio, old / 2), 2 * old), REFRESH_EMA)
                for k in self.since_ar:
                    self.relative[k] *= old / self.scale["ar"]
                self.refresh_moved = abs(self.scale["ar"] / old - 1.0)
                if self.refresh_moved <= REFRESH_MOVE:  # settled: the next refreshes follow at once until then
                    self.since_ar.clear()
            elif fam == "ar":
                _smooth(self.scale, "ar", ratio)
                self.since_ar.clear()
            elif "ar" in self.scale:  # against AR's speed now: a drift of the machine's moves both alike
                _smooth(self.relative, fam, ratio / self.scale["ar"])
                self.since_ar.add(fam)
            else:  # before the first bare AR round (`Planner.plan` runs one early) every kind reads this clock
                self.first_scale = ratio
        recent = self._recent.setdefault(fam, [])
        # forecasts are the ledger's; the target's draws are priced per verified node (`draw`)
        recent.append(max(0.0, seen.seconds - seen.model_seconds - seen.plan_seconds - seen.target_seconds) / R)
        del recent[:-9]
        self.overhead[fam] = sorted(recent)[len(recent) // 2]
        if seen.target_rows:
            self._draws.append(seen.target_seconds / seen.target_rows)
            del self._draws[:-9]
            self.draw = sorted(self._draws)[len(self._draws) // 2]
        # a kind not run lately drifts back towards AR's overhead: one slow round (a busy machine,
        # a first call) must not rule it out for the rest of the generation
        base = self.overhead.get("ar")
        if base is not None:
            for f, v in self.overhead.items():
                if f not in (fam, "ar") and v > base:
                    self.overhead[f] = v - 0.05 * (v - base)


def _smooth(table: dict[str, float], key: str, ratio: float, weight: float = EMA) -> None:
    """table[key] moved towards `ratio` by `weight` (set by the first); a stall (`PAUSE`) moves
    it as a round PAUSE x slower would."""
    old = table.get(key)
    table[key] = ratio if old is None else old + weight * (min(ratio, PAUSE * old) - old)


def _per_kind(table: dict[str, float], family: str, default: float) -> float:
    """table[family], else AR's, else the least measured, else `default` (read every round: no
    eager fallback)."""
    v = table.get(family)
    if v is None:
        v = table.get("ar")
    return min(table.values(), default=default) if v is None else v


# -- what a prompt chunk costs (the prefill's pricing: `prefill.Prefill.chunk_tokens`) ------------------------------
# A chunk stalls the running rows for its time. In a forward of its own it pays a whole pass over the weights
# however few its tokens; where it rides in the round's forward (`BatchForward.joins`) only what its tokens add.

GROUP_FIXED_TOKENS = 8  # without a cost model: a forward's fixed cost (its pass over the weights) in query tokens
CHUNK_EMA = 0.5  # weight of the latest chunk's measured / predicted time
PREFILL_FLOOR = 1  # the least a cost model's chunk may be
PREFILL_ROUNDS = 1.0  # a picked chunk's forward costs at most this many AR rounds of the live rows: a running
# row then waits at most about twice its usual gap between tokens while a long prompt joins
PREFILL_WHOLE_ROUNDS = 4.0  # what is left of a prompt goes in one chunk when it costs at most this many: a
# short prompt joins in one forward (a chunk pays a whole forward's weight reads however few its tokens)


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
    predicted chunk time. Assumes the cost grows with the width (a binary search).

    Example (times in any unit): AR rounds of the running rows take 30 and a chunk's forward is
    priced 10 + 1 a token, chunks having taken 1.5 times their price: a 2,000-token prompt goes in
    chunks of 10 tokens (1.5 x 20 <= 30) until what is left costs at most 4 rounds
    (1.5 x (10 + 70) = 120), then the last 70 in one."""
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


# -- the floor: whether speculation has paid, and every bet bounded by it ------------------------
@dataclass
class Ledger:
    """plan "auto"'s floor: whether speculation has paid, measured, and every bet bounded by it.

    The planner's forecasts are estimates; what a round actually cost and committed is not. The
    ledger prices every round the planner did anything for beyond a bare AR round (a forecast, a
    tree build, a lookup, a draft, a wider forward) in AR rounds: how many plain AR rounds the same
    wall time would have run (from the AR round time on these rows at this cache length,
    `Planner.seconds(AR)`), against how many AR rounds' worth of tokens it committed. Its `funds`
    are what the next bet may lose, in AR rounds:

        funds <- min(CAP, funds + EPS * rounds_of_time + gain),   gain = committed - rounds_of_time

    for every non-bare round (a bare round adds only EPS * its time), starting at CREDIT. A
    speculative round, whose worst case (only the bonus tokens committed) loses its cost over an AR
    round's, and the forecast that precedes any bet, are placed only while they fit the funds. So
    speculation that never pays loses at most EPS of the time (plus CREDIT and one bet's overshoot of
    its prediction), speculation that pays funds bigger bets up to CAP, and a bare AR round (no
    forecast: the planner's answer when it may not bet) pays nothing for any of it. The ledger
    carries over between generations with the same settings (a new one starts with no debt: a
    probe lost at the end of one answer had kept the next ones from every bet for a long time)
    and across a server's requests (which share one planner).

    A round that took more than PAUSE times its prediction was stalled by something it did not
    cause (a full collection of the cyclic GC among torch's many objects; another process): it is
    counted at PAUSE times the prediction, and a forecast's time at most PAUSE times the larger of its
    running estimate and PLAN_FIRST AR rounds. Charged whole, one such stall in a prompt's first lookup
    cost dozens of AR rounds and inflated the forecast estimate: no bet for the rest of a bench.

    Lookup bets may also draw on `shadow`: what lookup bets the funds could not cover would have
    won, in hindsight (`Shadow`: the row's own later tokens show how much of each chain a
    verification would have taken), up to `shadow_cap` AR rounds. A lookup bet that loses while the
    funds are below zero takes the deficit from it, empties it and halves the cap; one that wins
    restores the cap. Hindsight that real bets do not bear out so costs at most 2 SHADOW_CAP.
    So a generation that starts without funds in a text that repeats itself (a model's loop, a file
    copied) bets on its chains after the first hindsight win instead of after the many AR rounds
    of EPS that the forecasts' own cost ate. Chains never accepted win nothing in hindsight either.

    Example: drafts never accepted and a probe that loses 3 AR rounds: from CREDIT 1 the funds reach
    3 after 100 AR rounds; the probe is bet and lost (funds 0), and the next one waits for another
    150 AR rounds (3 / EPS): 3 of every 153 rounds' time.
    """

    funds: float = CREDIT  # AR rounds the next bet may lose
    won: float = 0.0  # AR rounds won (negative: lost) by non-bare rounds, in all (a measure, not a rule)
    rounds: float = 0.0  # every round's time in AR rounds, in all
    plan_seconds: float = 0.0  # running estimate of one forecast's time (per round)
    shadow: float = 0.0  # AR rounds lookup bets not placed would have won, in hindsight (lookup bets only)
    shadow_cap: float = SHADOW_CAP

    def may_bet(self, loss: float, lookup: bool = False) -> bool:
        """Whether a bet whose worst case loses `loss` AR rounds fits the funds (a lookup bet's:
        with what such bets would have won in hindsight)."""
        return loss <= self.funds + (self.shadow if lookup else 0.0)

    def credit(self, gain: float) -> None:
        """A lookup bet that was not placed would have gained `gain` AR rounds (`Shadow.gain`)."""
        self.shadow = min(self.shadow_cap, max(0.0, self.shadow + gain))

    def record(self, *, committed: float, seconds: float, ar_seconds: float, bare: bool,
               plan_seconds: float = 0.0, expected: float | None = None, lookup: bool = False) -> float:
        """Count one finished round: it committed `committed` AR rounds' worth of tokens in
        `seconds` (counted at most PAUSE x `expected`, its predicted time, when given), where an
        AR round takes `ar_seconds`; `lookup`: it was a lookup bet. Returns its gain in AR rounds
        (0 for a bare round: the reference itself)."""
        if expected is not None:
            seconds = min(seconds, PAUSE * expected)
        spent = seconds / max(ar_seconds, 1e-12)
        gain = 0.0 if bare else committed - spent
        self.funds = min(CAP, self.funds + EPS * spent + gain)
        if lookup and gain < 0 and self.funds < 0 < self.shadow:  # hindsight paid for it, and was wrong
            drawn = min(self.shadow, -self.funds)
            self.funds, self.shadow, self.shadow_cap = self.funds + drawn, 0.0, self.shadow_cap / 2
        elif lookup and gain > 0:
            self.shadow_cap = SHADOW_CAP
        self.won += gain
        self.rounds += spent
        if not bare:
            plan_seconds = min(plan_seconds, PAUSE * max(self.plan_seconds, PLAN_FIRST * ar_seconds))
            self.plan_seconds += PLAN_EMA * (plan_seconds - self.plan_seconds)
        return gain
