"""`plan="auto"`: before each round, choose the layout with the highest predicted tokens per second.

A round is: an optional draft pass (two-pass), then one forward over a tree of N draft nodes
(the top N of the PRESTO tree by path score; N = 0 is AR) plus m mask groups of G slots on the
m likeliest endpoints (one-pass: the next round's marginals come from the endpoint's group).
Its cost is read from the device's measured cost profile (`profile.CostProfile`, f(q, c)) plus
the per-round overhead measured during this generation; its yield is the expected number of
committed tokens, 1 + sum over nodes of P(node accepted), where a node's probability of being
accepted once its parent is comes from its own score, calibrated online against this
generation's observed acceptance (`Calibrator`).

Choosing the best rate is a ratio problem; it is solved the Dinkelbach way: with `rate` the
current tokens/s estimate, pick the option maximising  E - rate * C + D * [leaves marginals],
where D is the value of starting the next round with marginals (one round ahead, weighted by
the endpoint mass the groups cover). With `rate` equal to the best achievable one this is
exactly "maximise E / C". Rounds without marginals are AR or two-pass; every few of them (8,
doubling to 128 while speculation keeps losing) a probe puts one mask group on the root so that
a context that has become predictable is noticed.

Example (flat costs, as on a GPU): every option costs 1 ms, so E alone decides: the largest
tree with a group on every node wins. With CPU-like costs (f(544) = 15 f(1)) groups on every
node cost ~15 AR steps and lose to AR unless the tree is very likely to be accepted.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch

from selfspec.engine.calibration import Calibrator, PositionCalibrator, acceptance, local_scores
from selfspec.engine.layouts import AR, Option


MARGIN = 0.05  # speculative yields are estimates: they count 5% less than AR's one certain token
PROBE_MIN, PROBE_MAX = 8, 128  # AR rounds between probes for marginals (doubling while they lose)


@dataclass
class Forecast:
    """What the planner knows about the marginals at hand (None fields: no marginals)."""

    accept: torch.Tensor | list | None = None  # P(accepted) per node of the largest tree (index order); a list: a chain
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    scores: torch.Tensor | None = None  # path scores: the top-N subtree is the N best (`tree.top_nodes`)
    kind: str = "tree"  # "tree": from marginals; "lookup": a context chain (no marginals at hand)
    _lists: tuple | None = None

    def lists(self) -> tuple[list[float], list[int], list[int], list[int]]:
        """(accept, depths, parents, order) as Python lists; `order` lists the non-root nodes in
        the order `tree.top_nodes` takes them (score descending, shallower first)."""
        if self._lists is None and isinstance(self.accept, list):  # a chain given as plain floats
            n = len(self.accept)
            self._lists = (self.accept, list(range(n)), list(range(-1, n - 1)), list(range(1, n)))
        if self._lists is None:
            acc, dep, par = self.accept.tolist(), self.depths.tolist(), self.parents.tolist()
            n = len(acc)
            if self.scores is None:
                order = list(range(1, n))
            else:
                sc = self.scores.tolist()
                order = sorted(range(1, n), key=lambda v: (-sc[v], v))
            self._lists = (acc, dep, par, order)
        return self._lists

    def coverage(self, n: int) -> list[float]:
        """Share of the top-n subtree's endpoint mass held by its m likeliest endpoints, m = 1.."""
        acc, _, par, order = self.lists()
        sub = [0] + order[:n]
        child = dict.fromkeys(sub, 0.0)
        for v in sub[1:]:
            child[par[v]] += acc[v]
        mass = sorted((max(0.0, acc[v] - child[v]) for v in sub), reverse=True)
        total, out, run = max(sum(mass), 1e-12), [], 0.0
        for x in mass:
            run += x
            out.append(run / total)
        return out


class Planner:
    """Chooses each round's `Option` from a cost profile and calibrated acceptance.

    `cost(q, c)` is the predicted forward seconds; `budgets` the tree sizes considered;
    `group_sizes` the mask-group lengths; `block_length` the two-pass draft block.
    """

    def __init__(self, cost, *, budgets: list[int], group_sizes: list[int], block_length: int,
                 allow_two_pass: bool = True):
        self.cost = cost
        self.budgets = sorted(set([0] + [b for b in budgets if b > 0]))
        self.group_sizes = sorted(set(g for g in group_sizes if g >= 2))
        self.block_length = block_length
        self.allow_two_pass = allow_two_pass
        self._memo: dict[tuple[int, int], float] = {}
        self.calibrator = Calibrator()
        self.lookup_calibrator = PositionCalibrator()
        self.overhead: dict[str, float] = {}  # per-round seconds outside forwards, by family
        self._recent: dict[str, list[float]] = {}
        self.rate: float | None = None  # predicted tokens/s of the chosen layouts, smoothed (Dinkelbach's parameter)
        self.scale: float | None = None  # measured / profiled forward time, smoothed
        self.two_pass_yield: dict[int, float] = {}  # expected tokens of two-pass trees, smoothed
        self.last_yields: dict[int, float] = {0: 1.0}  # of the latest forecast, for rounds without one
        self.probe_every, self.since_probe = PROBE_MIN, 0
        self.ar_streak, self.rest, self.dormant = 0, 4, 0

    def fork(self) -> "Planner":
        """A copy for one generation: it reads what was learnt so far and writes only its own
        state, so generations in several threads never update one planner at once."""
        new = copy.copy(self)
        for name in ("calibrator", "lookup_calibrator", "overhead", "_recent", "two_pass_yield", "last_yields",
                     "_memo"):
            setattr(new, name, copy.deepcopy(getattr(self, name)))
        return new

    def begin(self) -> None:
        """Start a generation: what was learnt (calibration, overheads, time scale) carries over
        from earlier generations with the same settings; the rate estimate and probe clock restart."""
        self.rate, self.since_probe = None, 0
        self.last_yields = {0: 1.0}

    def note_choice(self, option: Option) -> None:
        """After 8 AR choices in a row the planner rests for 4, 8, ... 32 rounds (the runtime runs
        AR without asking it); any other choice halves the next rest. Speculation that keeps losing
        then costs ~nothing, one lucky round does not undo that, and the rest carries over into
        the next generation with the same settings."""
        if option.nodes or option.groups or option.draft_pass:
            self.ar_streak, self.rest = 0, max(4, self.rest // 2)
            return
        self.ar_streak += 1
        if self.ar_streak >= 8:
            self.dormant, self.rest, self.ar_streak = self.rest, min(2 * self.rest, 32), 0

    # -- the decoder's two calls --------------------------------------------------------------------
    def plan(self, forecast, c: int, room: int, has_marginals: bool) -> tuple[Option, object]:
        """The next round's `Option` and what `forecast()` drafted for it (the largest tree, a
        lookup chain as a list, or None). While resting after a run of AR choices (and without
        marginals at hand) it answers AR without drafting or forecasting anything."""
        if self.dormant > 0 and not has_marginals:
            self.dormant -= 1
            return AR, None
        f, drafted = forecast()
        option, _ = self.choose(f, c, room)
        self.note_choice(option)
        return option, drafted

    def observe(self, r) -> None:
        """After a round (`rounds.Round`): the calibrators learn which drafted nodes the verifier
        accepted (lookup chains by position and match length), two-pass yields are noted, and the
        round's time is compared with the profile's prediction."""
        tree, option, n = r.tree, r.option, r.n
        if option.draft_pass and n > 1:
            self.observe_two_pass(self.forecast_tree(tree))
        if n > 1 and option.source == "lookup":
            self.lookup_calibrator.update(n - 1, len(r.path) - 1, r.match)
        elif n > 1:
            on_path = torch.zeros(n, dtype=torch.bool)
            on_path[r.path] = True
            self.calibrator.update(local_scores(tree.scores, tree.parents), on_path[tree.parents[1:]], on_path[1:])
        if option is not AR:
            self.observe_time(option, r.seconds, r.forward_seconds, r.c)

    def forecast_tree(self, tree) -> Forecast:
        """P(accepted) of every node of a tree, from its scores through the calibration."""
        prob = self.calibrator.prob(local_scores(tree.scores, tree.parents))
        return Forecast(acceptance(prob, tree.parents), tree.parents, tree.depths, tree.scores)

    # -- bookkeeping from executed rounds -----------------------------------------------------------
    def observe_time(self, option: Option, seconds: float, forward_seconds: float, c: int = 0) -> None:
        """After a round: its overhead, and how the profile's forward time compares with reality."""
        predicted = self._f(option.query_tokens, c) + (self._f(self.block_length, c) if option.draft_pass else 0)
        if predicted > 0 and forward_seconds > 0:
            r = forward_seconds / predicted
            self.scale = r if self.scale is None else 0.9 * self.scale + 0.1 * r
        fam = _family(option)
        recent = self._recent.setdefault(fam, [])
        recent.append(max(0.0, seconds - forward_seconds))
        del recent[:-9]
        self.overhead[fam] = sorted(recent)[len(recent) // 2]  # a median: first-call costs do not linger
        # a family not run lately drifts back towards AR's overhead: one slow round (a busy
        # machine, a first call) must not rule it out for the rest of the generation
        base = self.overhead.get("ar")
        if base is not None:
            for f, v in self.overhead.items():
                if f != fam and f != "ar" and v > base:
                    self.overhead[f] = v - 0.05 * (v - base)

    def observe_two_pass(self, forecast: Forecast) -> None:
        for n, e in self._yields(forecast, 10**9).items():
            old = self.two_pass_yield.get(n)
            self.two_pass_yield[n] = e if old is None else 0.7 * old + 0.3 * e

    # -- prediction ----------------------------------------------------------------------------------
    def _f(self, q: int, c: int) -> float:
        """The profile's f(q, c), memoised per 32 cached tokens (the planner asks every round)."""
        key = (q, c >> 5)
        v = self._memo.get(key)
        if v is None:
            if len(self._memo) > 4096:
                self._memo.clear()
            v = self._memo[key] = self.cost(q, c)
        return v

    def _c(self, option: Option, c: int) -> float:
        s = self._f(option.query_tokens, c)
        if option.draft_pass:
            s += self._f(self.block_length, c)
        return s * (self.scale or 1.0) + self.overhead.get(_family(option), 0.0)

    @staticmethod
    def _yields(f: Forecast, max_depth: int) -> dict[int, float]:
        """Expected committed tokens of the top-N subtree (depth <= max_depth) for every N."""
        if f.accept is None:
            return {0: 1.0}
        acc, dep, _, order = f.lists()  # plain floats: a few dozen nodes, cheaper than tensor ops
        out, total = {0: 1.0}, 1.0
        for v in order:
            if dep[v] <= max_depth:
                total += acc[v]
                out[len(out)] = total
        return out

    def choose(self, f: Forecast, c: int, room: int) -> tuple[Option, dict]:
        """The option for this round and the predicted value of every candidate."""
        ar = Option(0)
        f1 = self._c(ar, c)
        rate = max(self.rate or 0.0, 1.0 / f1)  # never below AR's rate
        cap = lambda e: min(e, float(room)) * (1 - MARGIN)  # noqa: E731
        if f.accept is not None and f.kind == "tree":
            self.last_yields = self._yields(f, 10**9)
        y_all = self.last_yields
        # rounds that leave no marginals: AR, or a two-pass round (draft pass + tree)
        best, best_v = ar, 1.0 - rate * f1
        table = {ar.label: best_v}
        if self.allow_two_pass and room > 1 and (self.two_pass_yield or len(y_all) > 1):
            for n in self.budgets[1:]:
                e = self.two_pass_yield.get(n, y_all.get(min(n, max(y_all)), 1.0))
                o = Option(n, draft_pass=True)
                table[o.label] = v = cap(e) - rate * self._c(o, c)
                if v > best_v + 1e-12:
                    best, best_v = o, v
        y_look = None
        if f.kind == "lookup" and f.accept is not None:  # copy the context: verify-only chains
            y = y_look = self._yields(f, 10**9)
            for n in range(1, len(f.lists()[0])):
                o = Option(n, source="lookup")
                table[o.label] = v = cap(y[n]) - rate * self._c(o, c)
                if v > best_v + 1e-12:
                    best, best_v = o, v
        v_none = best_v
        if f.accept is None or f.kind == "lookup":
            # no marginals: AR-like rounds, and now and then a probe (a group on the root) that
            # buys marginals, so that a context that turns predictable is noticed
            self.since_probe += 1
            if room > 1 and self.since_probe >= self.probe_every and best.nodes == 0 and self.group_sizes:
                self.since_probe = 0
                return Option(0, 1, self.group_sizes[0]), table
            return self._chosen(best, table, c, room, y_look if best.source == "lookup" else y_all)
        # value of holding marginals of depth G-1 next round: one step ahead, over not holding them
        delta = {}
        for g in self.group_sizes:
            y = self._yields(f, g - 1)
            w = max(cap(y[min(n, max(y))]) - rate * self._c(Option(n, 1, g), c) for n in self.budgets)
            delta[g] = max(0.0, w - v_none)
        for n in self.budgets:
            if n > len(f.lists()[0]) - 1:
                break
            e = cap(y_all[n])
            options = [Option(n)]
            cover = f.coverage(n)
            m = 1
            while m <= n + 1:
                options += [Option(n, m, g) for g in reversed(self.group_sizes)]  # ties: deeper groups
                m = n + 1 if m < n + 1 and 2 * m > n + 1 else 2 * m
            for o in options:
                v = e - rate * self._c(o, c)
                if o.groups:
                    v += delta[o.group_size] * cover[min(o.groups, len(cover)) - 1]
                table[o.label] = v
                if v > best_v + 1e-12:
                    best, best_v = o, v
        if best.nodes == 0 and not best.groups:
            self.probe_every = min(self.probe_every * 2, PROBE_MAX)  # speculation lost: probe less often
        else:
            self.probe_every = PROBE_MIN
        return self._chosen(best, table, c, room, y_all)

    def _chosen(self, best: Option, table: dict, c: int, room: int, yields: dict) -> tuple[Option, dict]:
        """Move `rate` towards the predicted rate of the layout chosen (the Dinkelbach update)."""
        if best.draft_pass:
            e = self.two_pass_yield.get(best.nodes, yields.get(min(best.nodes, max(yields)), 1.0))
        else:
            e = yields.get(min(best.nodes, max(yields)), 1.0)
        r = min(e, float(room)) / self._c(best, c)
        self.rate = r if self.rate is None else 0.8 * self.rate + 0.2 * r
        return best, table


_STORE_LOCK = threading.Lock()


def planner_for(model, cfg, profile=None) -> Planner:
    """A planner for one generation with these settings, forked from the model's stored one so
    that what earlier generations learnt (acceptance calibration, overheads) starts this one
    (fading); `keep_planner` stores it back when the generation ends."""
    from selfspec.engine.profile import cost_model

    cost = cost_model(model, profile)
    key = (id(cost), cfg.temperature, cfg.top_k, cfg.top_p, cfg.budget, cfg.tree_top_k, cfg.block_length, cfg.group,
           cfg.lam, cfg.rho, cfg.lookup, cfg.lookup_min_ngram, cfg.lookup_max_ngram, cfg.lookup_tokens)
    with _STORE_LOCK:
        store = model.__dict__.setdefault("_selfspec_planners", {})
        stored = store.get(key)
        if stored is None:
            if len(store) > 32:
                store.clear()
            stored = store[key] = Planner(cost, budgets=log2_budgets(cfg.budget),
                                          group_sizes=sorted({min(4, cfg.group), min(8, cfg.group), cfg.group}),
                                          block_length=cfg.block_length)
        planner = stored.fork()
    planner.begin()
    planner.home = (store, key)
    return planner


def keep_planner(planner: Planner) -> None:
    """A finished generation's planner becomes the stored one for its settings (of generations
    running at once, the last to finish; none of them ever sees another's half-updated state)."""
    home = getattr(planner, "home", None)
    if home is not None:
        with _STORE_LOCK:
            home[0][home[1]] = planner


def _family(o: Option) -> str:
    return o.label.split("/")[0]


def log2_budgets(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (and `limit` itself): the tree sizes auto considers."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit] if limit >= 1 else out
