"""`plan="auto"`: before each round, the layout (`rounds.Option`) with the most predicted tokens
per second for the batch as it is, one row or many.

Every row of a round runs the same option in one forward of rows x width query tokens. Its cost
is the device's cost model f(rows, width, cache) (`cost.CostModel`; at the cheapest width the
round can be padded to), times a measured scale per kind of round, plus a measured overhead per
row per kind and a measured time per target token drawn (one per verified node); a two-pass
round adds its draft pass f(rows, block_length, cache). Its yield is the
rows' expected committed tokens: a row's is 1 + the sum over its draft nodes of P(node
accepted), forecast here from what the row can draft now: the PRESTO tree of its marginals (each
node's score read through a `Calibrator` learnt from the verifier), or its context-lookup chain
(by position and match length, `PositionCalibrator`); two-pass rounds use the yields two-pass
rounds had. When no request waits for a cache row the batch ends with its slowest row, so a round
is then worth the progress of the rows with the most tokens left (the least of theirs).

The choice is a ratio problem, solved the Dinkelbach way: with `rate` the current tokens/s
estimate, pick the option maximising  E - rate * C + D * [leaves marginals],  where D is the value
of starting the next round with marginals (one round ahead, weighted by the endpoint mass the
groups cover). With `rate` equal to the best achievable one this is exactly "maximise E / C".
Speculative yields count `MARGIN` less than AR's certain tokens, so noise falls back to AR.
Rounds without marginals are AR, lookup or two-pass; every `PROBE_MIN` of them (doubling to
`PROBE_MAX` while the rounds a probe's marginals led to keep losing time, as measured, and never
before the probe's extra time is under `PROBE_SHARE` of theirs) a probe puts one mask group on
each row's root, so a context that has become predictable is noticed (while the calibrated
forecast says a probe and the tree it buys beat AR, the round after each verification); after 8 AR choices in a
row the planner rests (AR without drafting or forecasting) for 4, 8, ... 32 rounds.

Example (flat costs, as on a GPU): every option costs the same, so E alone decides: the largest tree
with a group on every node wins. With CPU-like costs (f(544) = 15 f(1)) groups on every node cost
~15 AR steps and lose to AR unless the tree is very likely to be accepted.
"""

from __future__ import annotations

import copy
import math

import torch

from selfspec.engine.planning.calibration import (Calibrator, Forecast, PositionCalibrator, Shadow, acceptance,
                                                  follow, local_scores, walked)
from selfspec.engine.planning.choice import (PROBE_MAX, PROBE_MIN, PROBE_SHARE, Choice, last_rows, nothing_to_offer, plain,
                                    round_value)
from selfspec.engine.round.rounds import AR, Option, Seen
from selfspec.engine.request.request import round_room
from selfspec.engine.planning.round_costs import EPS, REFRESH_MOVE, START_MIN, Ledger, RoundCosts
from selfspec.engine.request.sequence import draft_tree, lookup_chain

MEASURE_AR = 16  # AR rounds' worth of time after which one AR round is run if none has been (the floor's reference)
SETTLE_AFTER = 4  # plain AR rounds are timed and accounted this many at a time (`Planner.settle`)
RUN_KEYS = 2  # lookup chains are calibrated apart after 0, 1 and 2+ chains of the row borne out whole (a text
# that repeats itself keeps doing so: chains of a model's loop were right ~every time, the others ~a third)
REST_MAX = 32  # the longest rest (AR rounds with nothing forecast) after a run of 8 AR choices
REFRESH_AR = 32  # rounds after which a bare AR round runs even while the planner bets: only bare rounds measure AR's
# time now (the floor's reference), and a machine that got faster during a streak of bets had the stale AR time
# price wrong chains as wins (`round_costs.REFRESH_EMA`; tests/test_floor.py runs it on a fake clock)


class Planner:
    """Chooses each round's `Option` (`plan`) and learns from the finished round (`observe`).

    `cost(rows, width, cache)` is a `cost.CostModel`; `cfg` the generation's `DecodeConfig` (how
    rows draft: budget, top-k, lookup); `budgets` the tree sizes considered (default 1, 2, 4, ...
    up to cfg.budget); `group_sizes` the mask-group lengths (default 4, 8 and cfg.group, at most
    cfg.group)."""

    def __init__(self, cost, cfg, *, budgets: list[int] | None = None, group_sizes: list[int] | None = None):
        # a round is never padded beyond the room its cache rows keep (`request.round_room`): past it the
        # forward grows the cache first
        self.costs = RoundCosts(cost, block_length=cfg.block_length, max_width=round_room(cfg))
        self.cfg = cfg
        self.budgets = sorted({0} | {b for b in (budgets or log2_budgets(cfg.budget)) if b > 0})
        self.group_sizes = sorted({x for x in group_sizes if x >= 2}) if group_sizes else default_group_sizes(cfg.group)
        self.calibrator = Calibrator()
        self.lookup_calibrator = PositionCalibrator()
        self.rates: dict[bool, float] = {}  # predicted rate of the chosen layouts (Dinkelbach), draining or not
        self.two_pass_yield: dict[int, float] = {}  # expected tokens per row of two-pass trees, smoothed
        self.last_yields: list[float] = [1.0]  # of the latest tree forecast, for rounds without one
        self.recent_trees: list = []  # the latest tree forecasts from marginals (`choice.probe_pays`)
        self.calibrated, self.pays_memo = 0, (None, None)  # calibration updates so far; probe_pays's latest answer
        self.probe_every, self.since_probe = PROBE_MIN, 0
        self.ar_streak, self.rest, self.dormant = 0, 4, 0
        self.since_bare = 0  # rounds since the latest bare AR round (`REFRESH_AR`)
        self.predicted: tuple[float, float] | None = None  # (tokens, seconds) of the latest choice
        self.ledger = Ledger()  # what speculation has won or lost: bounds every bet (`round_costs.Ledger`)
        self.probe_loss = 0.0  # AR rounds the latest losing probe lost, with the rounds its marginals led to
        self.last_win = 0.0  # AR rounds the latest winning marginals' episode won (0: it lost, or none yet)
        self.marg_gain: float | None = None  # AR rounds won by the latest marginals' rounds (None: none at hand)
        self.unsettled: list[Seen] = []  # rounds observed while resting, not yet timed and accounted
        self.trailing = 0.0  # seconds `observe` took after the latest round's clock stopped: the next round's
        # planning time (AR mode does none of it; uncharged, it went past the ledger's bound)
        self.shadows: dict = {}  # sequence -> `calibration.Shadow`: its lookup chain not verified, followed in hindsight
        self.blocked: tuple | None = None  # the latest choice's refused lookup bet: (value, option, AR rounds)

    def fork(self) -> "Planner":
        """A copy for one generation: it reads what was learnt so far and writes only its own
        state, so generations in several threads never update one planner at once."""
        self.settle()
        new = copy.copy(self)
        for name in ("calibrator", "lookup_calibrator", "two_pass_yield", "rates", "ledger", "unsettled"):
            setattr(new, name, copy.deepcopy(getattr(self, name)))
        new.costs = self.costs.fork()
        new.shadows = {}
        return new

    def begin(self) -> None:
        """Start a generation: what was learnt (calibration, overheads, time scale) carries over
        from earlier generations with the same settings, the ledger's funds without a debt (a probe
        lost at the end of one answer had left the next ones without a bet for a long time; capping
        what a generation inherits at 2 AR rounds was slower on code, no faster on chat); the rate
        estimate restarts. The probe clock runs on: a probe's spacing bounds the share of time it
        risks, whatever the answers' lengths (restarted per answer, a probe several AR steps dear
        never came in short answers, so drafts that succeed went unseen)."""
        self.rates, self.last_yields, self.trailing, self.shadows = {}, [1.0], 0.0, {}
        self.ledger.funds = max(self.ledger.funds, START_MIN)

    def marginals_at_prefill(self, rows: int, cache: int, group: int, room: int) -> bool:
        """Whether a prefill adds a mask group per row, so that the first round has marginals.
        It is a probe's bet: taken while marginals have lately paid (`probe_every` at its least)
        and while its extra forward costs at most one AR step (flat costs: a GPU), PROBE_SHARE of
        the rows' AR time to come, or less than the latest marginals' episode won (`last_win`)."""
        self.settle()
        if self.probe_every > PROBE_MIN or not self.group_sizes:
            return False
        extra = self.costs.model_seconds("one-pass", rows, group, cache)
        ar = self.costs.seconds(AR, rows, cache)[1]
        loss = extra / ar  # in AR rounds; worst case: the marginals buy nothing
        # dear, it still pays where the latest marginals won more than it risks (drafts that succeed)
        dear = extra > ar * max(1.0, PROBE_SHARE * room) and self.last_win <= loss
        if dear or not self.ledger.may_bet(loss):
            return False
        self.ledger.funds -= loss  # charged now: the prefill is no round the ledger sees
        self.marg_gain = (self.marg_gain or 0.0) - loss  # and to the marginals it buys
        return True

    # -- plan ------------------------------------------------------------------------------------------
    def plan(self, rnd) -> Option:
        """The option for this round (`rounds.Round`). Each row's forecast is what its draft step
        then reads (`RowRound.big`: the largest tree; `.drafted`: the lookup chain). While resting
        after a run of AR choices, with no marginals at hand, AR without forecasting anything."""
        resting = self.dormant > 0 and all(r.marg is None for r in rnd.rows)
        if resting:
            self.dormant -= 1
        elif self._settle_due():  # what the rest's rounds measured, before anything is weighed
            self.settle()
        unmeasured = "ar" not in self.costs.scale and self.ledger.rounds > MEASURE_AR  # the ledger's reference, once
        stale = self.since_bare >= REFRESH_AR or self.costs.refresh_moved > REFRESH_MOVE
        refresh = (not (resting or unmeasured) and stale
                   and "ar" in self.costs.scale and all(r.marg is None for r in rnd.rows))  # the reference, again
        if not (resting or unmeasured or refresh):
            R, cache = len(rnd.rows), rnd.cache_len
            loss = (self.ledger.plan_seconds + self.costs.forecast_drag(R, cache)) / self.costs.seconds(AR, R, cache)[1]
            if not self.ledger.may_bet(loss):  # the forecast is a bet too: rest until the funds cover it
                # (they grow by EPS an AR round), its rounds settled in one batch then
                self.dormant = max(0, math.ceil((loss - self.ledger.funds) / EPS) - 1)
                resting = True
        if resting or unmeasured or refresh:
            self.predicted = None  # a bare AR round: nothing forecast
            rnd.bare, rnd.refresh = True, refresh
            if refresh:  # this round measures AR's time again; its settling says how far that moved it
                self.costs.refresh_moved = 0.0
            return AR
        for r in rnd.rows:
            r.forecast = self.forecast(r)
        self.blocked = None
        if nothing_to_offer(self, rnd.rows, rnd.cache_len, rnd.draining):
            option = plain(self, rnd.rows, rnd.cache_len, rnd.draining)
        else:
            option = self.choose(rnd.rows, rnd.cache_len, rnd.draining)
        self.note_choice(option)
        if option.draft != "lookup":
            self._shadow(rnd, self.blocked)
        return option

    def _shadow(self, rnd, blocked) -> None:
        """Rows whose lookup chain this round does not verify follow it in hindsight (`calibration.Shadow`),
        one chain a row at a time (as if each were verified when read). With the lookup bet the
        ledger could not afford (`blocked`), each row carries its share of what that bet would
        have gained; a row without a chain would have run AR in its wider forward (credited now)."""
        R, k, spent = len(rnd.rows), 0, 0.0
        if blocked is not None and not (rnd.draining and R > 1) and not any(r.seq in self.shadows for r in rnd.rows):
            k, spent = blocked[1].nodes, blocked[2]
        for r in rnd.rows:
            if r.drafted and r.forecast is not None and r.forecast.kind == "lookup":
                if r.seq not in self.shadows:
                    self.shadows[r.seq] = Shadow(list(r.drafted), r.chain_key, k, 1.0 / R, spent)
            elif k:
                self.ledger.credit((1.0 - spent) / R)

    def _follow(self, rnd) -> None:
        """Each row's shadow chain against the tokens it committed this round; an ended one is
        evidence for the lookup calibration and, with its bet, hindsight for the ledger."""
        for r in rnd.rows:
            s = self.shadows.get(r.seq)
            if s is None:
                continue
            s.seen, ended = follow(s.chain, s.seen, r.committed)
            ended = ended or r.seq.done
            if s.k and not s.credited and (ended or s.seen >= s.k):  # the bet's outcome is known
                self.ledger.credit(s.gain(s.seen))
                s.credited = True
            if ended:
                del self.shadows[r.seq]
                self._shadow_ended(s, r.seq)
        if len(self.shadows) > len(rnd.rows):  # rows that left without a round (cancelled)
            self.shadows = {q: s for q, s in self.shadows.items() if not (q.done or q.cancelled)}

    def _follow_rest(self, r, n: int) -> None:
        """A lookup round accepted all n verified tokens of a longer chain: its rest is followed in
        hindsight from the bonus token on, so positions past the bets' lengths are learnt too (else
        a calibration kept at its prior there caps the chains at the lengths it has seen)."""
        s = Shadow(list(r.drafted), r.chain_key, seen=n, start=n)
        s.seen, ended = follow(s.chain, n, r.committed[n:])
        if ended or r.seq.done:
            self._shadow_ended(s, r.seq)
        else:
            self.shadows[r.seq] = s

    def _shadow_ended(self, s: Shadow, seq) -> None:
        self.lookup_calibrator.update(len(s.chain), s.seen, s.key, fade=s.start == 0, start=s.start)
        if s.start == 0:  # a verified chain's rest: its round counted the run already
            seq.lookup_run = seq.lookup_run + 1 if s.seen == len(s.chain) else 0

    def forecast(self, r) -> Forecast:
        """The row's largest draft (kept on the row) and P(accepted) of each of its nodes."""
        if r.room <= 1:
            return Forecast()
        if r.marg is None:
            if r.seq.lookup is None or self.cfg.mode != "auto":  # a PRESTO planner drafts trees only
                return Forecast()
            r.drafted = lookup_chain(r.seq, self.cfg, r.room)
            r.chain_key = (r.seq.match, min(r.seq.lookup_run, RUN_KEYS))
            if not r.drafted:
                return Forecast()
            acc, run = [1.0], 1.0
            for p in self.lookup_calibrator.prob(len(r.drafted), r.chain_key):
                run *= p
                acc.append(run)
            return Forecast(acc, kind="lookup")
        r.big = draft_tree(r.seq, self.cfg, r.marg, self.cfg.budget, r.room, linear=False)
        return self.forecast_tree(r.big)

    def forecast_tree(self, tree) -> Forecast:
        """P(accepted) of every node of a tree, from its scores through the calibration."""
        prob = self.calibrator.prob(local_scores(tree.scores, tree.parents))
        return Forecast(acceptance(prob, tree.parents), tree.parents, tree.depths, tree.scores, "tree")

    def note_choice(self, option: Option) -> None:
        """After 8 AR choices in a row the planner rests for 4, 8, ... 32 rounds; any other choice
        halves the next rest. Speculation that keeps losing then costs ~nothing, one lucky round
        does not undo that, and the rest carries over to the next generation with the same settings."""
        if option.speculative:
            self.ar_streak, self.rest = 0, max(4, self.rest // 2)
            return
        self.ar_streak += 1
        if self.ar_streak >= 8:
            self.dormant, self.rest, self.ar_streak = self.rest, min(2 * self.rest, REST_MAX), 0

    # -- choose ------------------------------------------------------------------------------------------
    def choose(self, rows, cache: int, draining: bool = False) -> Option:
        """The option for these rows (`RowRound`s with their `forecast`s) over `cache` cached tokens;
        `blocked` keeps the lookup bet that would have beaten AR had the ledger afforded it."""
        c = Choice(self, rows, cache, draining)
        option = c.best()
        if c.blocked is not None and c.blocked[0] > c.ar_value - c.rate * c.ar_seconds:
            self.blocked = c.blocked
        return option

    # -- observe -----------------------------------------------------------------------------------------
    def observe(self, rnd) -> None:
        """After a round: the calibrators learn which drafted nodes the verifier accepted (trees by
        node score; lookup chains by position and match length; evidence fades once per round,
        not once per row), two-pass yields are noted, and the round's times are compared with the
        cost model's prediction."""
        option, faded, first, yields = rnd.option, set(), True, []
        if self.shadows:
            self._follow(rnd)
        judged = set()
        for r in rnd.rows:  # greedy rows: the tokens committed judge the whole forecast tree
            tree = getattr(r, "big", None)
            if tree is not None and len(tree) > 1 and r.committed and r.seq.params.temperature == 0:
                reached, accepted = walked(tree.tokens.tolist(), tree.parents.tolist(), r.committed)
                self.calibrator.update(local_scores(tree.scores, tree.parents), torch.tensor(reached),
                                       torch.tensor(accepted), fade=first)
                first = False
                judged.add(id(r))
                self.calibrated += 1
        for r in (rnd.rows if option.nodes or option.draft_pass else ()):  # AR rounds and probes drafted nothing
            n = r.nodes
            if n == 0:
                continue
            if option.draft == "lookup":
                self.lookup_calibrator.update(n, len(r.path) - 1, r.chain_key, fade=r.chain_key not in faded)
                faded.add(r.chain_key)
                r.seq.lookup_run = r.seq.lookup_run + 1 if len(r.path) - 1 == n else 0
                if len(r.path) - 1 == n < len(r.drafted) and r.seq not in self.shadows:
                    self._follow_rest(r, n)
                continue
            if option.draft_pass:
                yields.append(self.forecast_tree(r.tree).yields())
            if id(r) in judged and not option.draft_pass:  # a two-pass tree came from its own draft pass
                continue
            on_path = torch.zeros(n + 1, dtype=torch.bool)
            on_path[r.path] = True
            tree = r.tree
            self.calibrator.update(local_scores(tree.scores, tree.parents), on_path[tree.parents[1:]], on_path[1:],
                                   fade=first)
            first = False
        if yields:
            self._observe_two_pass(yields)
        if rnd.join_tokens:  # a prompt's chunk shared the forward: its time is not this round's option's
            return
        self.since_bare = 0 if rnd.bare else self.since_bare + 1
        rooms, trailing, self.trailing = [r.room for r in rnd.rows], self.trailing, 0.0
        seen = Seen(rnd.option, len(rnd.rows), rnd.width, rnd.cache_len, rnd.model_seconds, rnd.seconds + trailing,
                    rnd.plan_seconds + trailing, rnd.bare, rnd.draining,
                    round_value([len(r.committed) for r in rnd.rows], rooms, last_rows(rooms, rnd.draining)),
                    rnd.option.groups > 0 or any(r.marg is not None for r in rnd.rows), rnd.target_seconds,
                    rnd.target_rows, rnd.refresh)
        self.unsettled.append(seen)
        if not (rnd.bare and self.dormant > 0) and self._settle_due():
            self.settle()

    def _settle_due(self) -> bool:
        """Whether the rounds not yet settled must be now: a round that drafted or had marginals at
        hand (its outcome moves the next choice), one that closes the marginals' episode, or
        SETTLE_AFTER plain AR rounds. A plain AR round moves the funds by EPS and the AR time by a
        tenth of its error, so the choices in between read numbers at most three rounds old, and
        the planner's Python runs once for four (right after a forward its first round runs cold,
        so settling four at a time costs less a round than one at a time)."""
        if len(self.unsettled) >= SETTLE_AFTER or (self.unsettled and self.marg_gain is not None):
            return True
        last = self.unsettled[-1] if self.unsettled else None
        return last is not None and (last.option is not AR or last.marginals or last.refresh)

    def settle(self) -> None:
        """Rounds observed but not yet timed and accounted, in order. A resting round (bare, more
        to come) leaves its numbers here until the rest ends: nothing reads the scale or the ledger
        while the planner rests, and the same arithmetic on a batch of rounds runs with warm
        caches (right after a forward it runs cold)."""
        for seen in self.unsettled:
            self.costs.observe(seen)
            self._account(seen)
        self.unsettled.clear()

    def _account(self, seen: "Seen") -> None:
        """The round into the ledger: its committed progress against AR's in the same time."""
        R = seen.rows
        ar = self.costs.seconds(AR, R, seen.cache_len)[1]
        expected = (ar if seen.option is AR else self.costs.seconds(seen.option, R, seen.cache_len)[1]) + (
            0.0 if seen.bare else self.ledger.plan_seconds)
        seconds = seen.seconds
        if seen.option is AR and not seen.bare:  # its forward is AR's own: what it lost is the planning and
            # the forward's measured drag after it, smoothed. Its own measured time also held the forward's
            # noise, and one 2x stall (another process) put a 1k-token generation 1.1 AR rounds in debt
            seconds = ar + seen.plan_seconds + self.costs.forecast_drag(R, seen.cache_len)
        gain = self.ledger.record(committed=seen.value / (1.0 if seen.draining else R), seconds=seconds,
                                  ar_seconds=ar, bare=seen.bare, plan_seconds=seen.plan_seconds, expected=expected,
                                  lookup=seen.option.draft == "lookup")
        if seen.marginals:
            self.marg_gain = (self.marg_gain or 0.0) + gain
        elif self.marg_gain is not None:
            self.close_episode()

    def close_episode(self) -> None:
        """Marginals ran out (a probe's, the prefill's): if the rounds that used them, the probe's
        and the forecasts' time included, won time over AR, probes come every PROBE_MIN rounds;
        else half as often as before (down to every PROBE_MAX). Judged on what the rounds took and
        committed, not on what was forecast: a calibration that overrates the marginals would
        otherwise keep probing at the least spacing while every episode loses."""
        won = self.marg_gain is not None and self.marg_gain > 0
        self.probe_every = PROBE_MIN if won else min(2 * self.probe_every, PROBE_MAX)
        self.probe_loss = 0.0 if won else -(self.marg_gain or 0.0)
        self.last_win = self.marg_gain if won else 0.0
        self.marg_gain = None

    def _observe_two_pass(self, yields: list[list[float]]) -> None:
        for n in self.budgets[1:]:
            reached = [y[n] for y in yields if len(y) > n]  # trees with n nodes at least
            if reached:
                e = sum(reached) / len(reached)
                old = self.two_pass_yield.get(n)
                self.two_pass_yield[n] = e if old is None else 0.7 * old + 0.3 * e


def default_group_sizes(g: int) -> list[int]:
    """The mask-group lengths auto considers for groups of at most `g`: 4, 8 and g."""
    return sorted({x for x in (min(4, g), min(8, g), g) if x >= 2})


def log2_budgets(limit: int) -> list[int]:
    """1, 2, 4, ... up to `limit` (and `limit` itself): the tree sizes auto considers."""
    out, n = [], 1
    while n < limit:
        out.append(n)
        n *= 2
    return out + [limit] if limit >= 1 else out
