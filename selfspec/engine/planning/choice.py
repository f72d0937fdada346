"""One round's choice for the planner (`planner.Planner.choose`): every candidate option valued for
the rows at hand, the Dinkelbach way (see `planner.py`'s docstring), and the probe for marginals.
Bets are bounded by the planner's ledger (`round_costs.Ledger`)."""

from __future__ import annotations

from functools import lru_cache

from selfspec.engine.planning.calibration import Forecast, at
from selfspec.engine.round.rounds import AR, Option

MARGIN = 0.05  # speculative yields are estimates: they count 5% less than AR's certain tokens
PROBE_MIN, PROBE_MAX = 8, 128  # AR rounds between probes for marginals (doubling while they lose)
PROBE_SHARE = 0.03  # and at least enough of them that what a probe loses is at most this share of their time:
# the floor's tolerance (auto at least 1 - PROBE_SHARE of AR); at 0.1, probes whose marginals never paid (a 4-token
# group with the draft LoRA on a CPU, its head rows and the tree forecast after it) cost more than that tolerance


def last_rows(rooms: list[int], draining: bool) -> list[int] | None:
    """Draining (no request waits for a row: the batch ends with its slowest rows), the rows with
    the most tokens left, whose progress a round is worth; else None (every row's counts)."""
    if not draining:
        return None
    top = max(rooms)
    return [i for i, room in enumerate(rooms) if room == top]


def round_value(per_row: list[float], rooms: list[int], last: list[int] | None) -> float:
    """What a round's tokens are worth to the batch: the rows' sum (each capped at its room), or
    the least of the `last_rows`. The planner values options and prices finished rounds by it.
    Example: per_row [3, 1], rooms [10, 4] -> 4; draining (last [0]) -> 3."""
    capped = [min(e, room) for e, room in zip(per_row, rooms)]
    return sum(capped) if last is None else min(capped[i] for i in last)


@lru_cache(maxsize=256)
def lookup_option(k: int) -> Option:
    """Option("lookup", k), made once: every forecast round offers k = 1 .. the longest chain."""
    return Option("lookup", k)


def nothing_to_offer(pl, rows, cache: int, draining: bool) -> bool:
    """No row drafts anything this round that could win (no marginals; no lookup chain, or none
    whose best case beats AR: `lookup_hopeless`) and no two-pass option applies: the round is AR
    or a probe (`plain`, what `Choice.best` would pick then), and the options need no valuing."""
    if not (max(r.room for r in rows) <= 1 or not (pl.two_pass_yield or len(pl.last_yields) > 1)):
        return False
    kinds = {r.forecast.kind if r.forecast is not None else "none" for r in rows}
    return kinds == {"none"} or (kinds <= {"none", "lookup"} and lookup_hopeless(pl, rows, cache, draining))


def lookup_hopeless(pl, rows, cache: int, draining: bool) -> bool:
    """No lookup option can beat AR in `Choice`: valued with every row's whole chain accepted as
    forecast and at the least time of any chain length, it is still worth less than AR (most
    forecast rounds of a chat: a one-token match whose chain the calibration gives ~nothing;
    valuing each length there cost a visible share of a round).

    Example (times in AR rounds): AR 1 token a round (value 0); a chain whose tokens add 0.05
    expected in at least 1.15 rounds: 1.05 x 0.95 - 1.15 < 0, hopeless."""
    R, longest, per_row = len(rows), 0, []
    for r in rows:
        f = r.forecast
        if f is not None and f.kind == "lookup":
            longest = max(longest, len(f.accept) - 1)
            per_row.append(sum(f.accept))  # the root's 1 and every node's P(accepted)
        else:
            per_row.append(1.0)
    ar_seconds = pl.costs.seconds(AR, R, cache)[1]
    ar_value = 1.0 if draining else float(R)
    rate = max(pl.rates.get(draining, 0.0), ar_value / ar_seconds)
    rooms = [r.room for r in rows]
    best = round_value(per_row, rooms, last_rows(rooms, draining))
    least = pl.costs.least_seconds("lookup", R, longest, cache)
    return best * (1 - MARGIN) - rate * least <= ar_value - rate * ar_seconds


def plain(pl, rows, cache: int, draining: bool) -> Option:
    """`Choice.best` for a round with nothing to offer: AR, or a probe when one is due, for the
    price of one AR time (about half a `Choice`'s; the planner runs this on most forecast rounds)."""
    pl.since_probe += 1
    R = len(rows)
    ar_seconds = pl.costs.seconds(AR, R, cache)[1]
    ar_value = 1.0 if draining else float(R)
    probe = due_probe(pl, R, cache, [r.room for r in rows], ar_seconds)
    if probe is not None:
        pl.predicted = (ar_value, probe[1])
        return probe[0]
    chosen(pl, draining, ar_value, ar_seconds)
    return AR


def chosen(pl, draining: bool, tokens: float, seconds: float) -> None:
    """The choice's prediction kept, and `rate` moved towards its predicted rate (the Dinkelbach
    update)."""
    pl.predicted = (tokens, seconds)
    r, old = tokens / seconds, pl.rates.get(draining)
    pl.rates[draining] = r if old is None else 0.8 * old + 0.2 * r


def due_probe(pl, R: int, cache: int, rooms: list[int], ar: float) -> tuple[Option, float] | None:
    """(the probe, its predicted seconds) when this AR-like round should put one mask group on
    each row's root instead, else None. A probe commits what AR would: its extra time is a bet,
    kept under PROBE_SHARE of the AR time between probes (its predicted extra time, or what the
    latest probe lost with the rounds its marginals led to when that was more: on a CPU a group
    with the draft LoRA costs several AR steps, and the tree forecast after it more) and within the
    ledger's funds; where the latest marginals' episode won more than the probe risks
    (`last_win`), every `probe_every` rounds. While `probe_pays`, the round after the latest
    probe's verification: probe, verify, probe is then the best cycle without hindsight."""
    if (pl.since_probe < 1 or max(rooms) <= 1 or not pl.group_sizes  # never twice in a row
            or (pl.since_probe < PROBE_MIN and not pl.recent_trees)):
        return None
    probe = Option(groups=1, group_size=pl.group_sizes[0])
    cost = pl.costs.seconds(probe, R, cache)[1]
    pays = probe_pays(pl, R, cache, ar, cost, probe.group_size - 1)
    # a probe that pays comes right away: a cycle of probe and verification is the best layout
    # there (the replay's best without hindsight); one that does not, every `probe_every` rounds
    if pl.since_probe < (1 if pays else max(PROBE_MIN, pl.probe_every)):
        return None
    loss = max(cost / ar - 1.0, pl.probe_loss)
    # spaced by what it risks, unless the latest marginals won more than that, or the calibrated
    # forecast says a probe and the tree it buys beat AR (drafts that succeed: spaced by loss, a probe
    # several AR steps dear waited longer than most answers)
    paid = pl.last_win > loss or pays
    if (paid or pl.since_probe >= loss / PROBE_SHARE) and pl.ledger.may_bet(cost / ar - 1.0):
        pl.since_probe = 0
        return probe, cost
    return None


RECENT_TREES = 4  # the marginals' trees `probe_pays` averages: one tree that happened to read low stopped
# every probe after it (no newer tree came to replace it), while the trees before it had paid


def probe_pays(pl, R: int, cache: int, ar: float, cost: float, reach: int) -> bool:
    """Whether the latest marginals' trees (`Planner.recent_trees`, `Forecast`s), read through the
    calibration as it is now (every greedy round's tokens keep it up to date:
    `calibration.walked`), say on average that a probe of `cost` seconds and a verification of its
    best top-N tree (`reach` deep) after it commit more than AR in their time:
    1 + E(N) (1 - MARGIN) > (probe + verification) / AR round. Where drafts fail the calibration
    reads them low and this is never true; the ledger still bounds every probe."""
    trees = pl.recent_trees
    if not trees:
        return False
    key = (pl.calibrated, tuple(id(t) for t in trees), reach)
    if pl.pays_memo[0] == key:
        ys = pl.pays_memo[1]
    else:
        each = [pl.forecast_tree(t).yields(reach) for t in trees]
        ys = [sum(y[n] for y in each) / len(each) for n in range(min(len(y) for y in each))]
        pl.pays_memo = (key, ys)
    for n in pl.budgets[1:]:
        if n >= len(ys):
            break
        verify = pl.costs.seconds(Option("tree", n), R, cache)[1]
        if 1.0 + ys[n] * (1 - MARGIN) > (cost + verify) / ar:
            return True
    return False


class Choice:
    """One round's choice (`Planner.choose`): every candidate option valued for these rows."""

    def __init__(self, pl, rows, cache: int, draining: bool):  # pl: planner.Planner
        self.pl, self.rows, self.cache, self.draining = pl, rows, cache, draining
        self.R = len(rows)
        self.rooms = [r.room for r in rows]
        self.fc = [r.forecast if r.forecast is not None else Forecast() for r in rows]
        self.last = last_rows(self.rooms, draining)
        self.tree_rows = [i for i, f in enumerate(self.fc) if f.kind == "tree"]
        self.ys = [f.yields() for f in self.fc]
        if self.tree_rows:
            ys = [self.ys[i] for i in self.tree_rows]
            longest = max(len(y) for y in ys)
            pl.last_yields = [sum(at(y, n) for y in ys) / len(ys) for n in range(longest)]
            pl.recent_trees = (pl.recent_trees + [self.fc[self.tree_rows[0]]])[-RECENT_TREES:]  # `probe_pays`
        ar_seconds = pl.costs.seconds(AR, self.R, cache)[1]
        self.ar_value = 1.0 if draining else float(self.R)
        self.rate = max(pl.rates.get(draining, 0.0), self.ar_value / ar_seconds)
        self.best_option, self.best_value = AR, self.ar_value - self.rate * ar_seconds
        self.best_e, self.best_seconds = self.ar_value, ar_seconds
        self.ar_seconds = ar_seconds
        self.blocked: tuple[float, Option, float] | None = None  # (value, option, its time in AR rounds): the
        # best lookup option the ledger could not afford, whose hindsight the planner follows (`calibration.Shadow`)

    def affordable(self, o: Option, seconds: float) -> bool:
        """The ledger allows a speculative round of `seconds`: its worst case (only the bonus
        tokens committed) loses its time over an AR round's, in AR rounds."""
        return self.pl.ledger.may_bet(seconds / self.ar_seconds - 1.0, lookup=o.draft == "lookup")

    def total(self, per_row: list[float]) -> float:
        """Committed tokens of the round from each row's expectation (`round_value`)."""
        return round_value(per_row, self.rooms, self.last)

    def offer(self, o: Option, per_row: list[float], bonus: float = 0.0) -> float:
        width, seconds = self.pl.costs.seconds(o, self.R, self.cache)
        afford = not o.speculative or self.affordable(o, seconds)
        if not (afford or o.draft == "lookup"):
            return float("-inf")
        e = self.total(per_row)
        value = e * (1 - MARGIN) - self.rate * seconds + bonus
        if not afford:
            if self.blocked is None or value > self.blocked[0]:
                self.blocked = (value, o, seconds / self.ar_seconds)
            return float("-inf")
        if width > o.width:
            o = Option(o.draft, o.nodes, o.groups, o.group_size, o.draft_pass, width)
        if value > self.best_value + 1e-12:
            self.best_option, self.best_value, self.best_e, self.best_seconds = o, value, e, seconds
        return value

    def best(self) -> Option:
        pl = self.pl
        self._two_pass()
        self._lookup()
        if not self.tree_rows:  # no marginals: AR-like rounds, and now and then a probe
            pl.since_probe += 1
            if not self.best_option.speculative:
                probe = due_probe(pl, self.R, self.cache, self.rooms, self.ar_seconds)
                if probe is not None:
                    pl.predicted = (self.ar_value, probe[1])
                    return probe[0]
            return self._chosen()
        self._trees()  # whether these marginals paid is judged when they run out (`Planner.close_episode`)
        return self._chosen()

    def _two_pass(self) -> None:
        """Rounds that leave no marginals: a draft pass and a verification of each row's top-N tree."""
        pl = self.pl
        if max(self.rooms) <= 1 or not (pl.two_pass_yield or len(pl.last_yields) > 1):
            return
        for n in pl.budgets[1:]:
            e = pl.two_pass_yield.get(n, at(pl.last_yields, n))
            self.offer(Option("tree", n, draft_pass=True), [e if room > 1 else 1.0 for room in self.rooms])

    def _lookup(self) -> None:
        """Rows with a context chain verify its first k tokens (the others AR)."""
        chains = [i for i, f in enumerate(self.fc) if f.kind == "lookup"]
        if not chains:
            return
        longest = max(len(self.ys[i]) for i in chains) - 1
        for k in range(1, longest + 1):
            per_row = [at(self.ys[i], k) if self.fc[i].kind == "lookup" else 1.0 for i in range(self.R)]
            self.offer(lookup_option(k), per_row)

    def _trees(self) -> None:
        """Verify-only trees of the top-N nodes, and the same with m groups of G slots (one-pass),
        whose marginals are worth `delta[G]` next round, weighted by the endpoint mass they cover."""
        pl, v_none = self.pl, self.best_value
        delta = {}
        for g in pl.group_sizes:
            ys = [f.yields(g - 1) if f.kind == "tree" else [1.0] for f in self.fc]
            w = max(self._value_at(Option("tree", n, 1, g) if n else Option(groups=1, group_size=g),
                                   [at(y, n) for y in ys]) for n in pl.budgets)
            delta[g] = max(0.0, w - v_none)
        largest = max(len(self.ys[i]) for i in self.tree_rows) - 1
        for n in pl.budgets:
            if n > largest:
                break
            per_row = [at(y, n) for y in self.ys]
            covers = [self.fc[i].coverage(n) for i in self.tree_rows]
            options = [Option("tree", n) if n else AR]
            m = 1
            while m <= n + 1:
                options += [Option("tree" if n else "none", n, m, g) for g in reversed(pl.group_sizes)]  # ties: deeper
                m = n + 1 if m < n + 1 and 2 * m > n + 1 else 2 * m
            for o in options:
                bonus = 0.0
                if o.groups:
                    bonus = delta[o.group_size] * sum(c[min(o.groups, len(c)) - 1] for c in covers) / len(covers)
                self.offer(o, per_row, bonus)

    def _value_at(self, o: Option, per_row: list[float]) -> float:
        return self.total(per_row) * (1 - MARGIN) - self.rate * self.pl.costs.seconds(o, self.R, self.cache)[1]

    def _chosen(self) -> Option:
        chosen(self.pl, self.draining, self.best_e, self.best_seconds)
        return self.best_option
