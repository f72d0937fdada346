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
of EPS that the forecasts' own cost ate (a long edit prompt had run nearly every round AR, its
chains all correct). Chains never accepted win nothing in hindsight either.

Example: AR rounds of 10 ms, drafts never accepted, a probe that costs 40 ms (3 AR rounds lost):
from CREDIT 1 the funds reach 3 after 100 AR rounds; the probe is bet and lost (funds 0), and the
next one waits for another 150 AR rounds: 3 of every 153 rounds' time.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class Ledger:
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


# -- shadows: the lookup bets not placed, followed in hindsight --------------------------------------
@dataclass
class Shadow:
    """A lookup chain `auto` read but did not verify, followed as the row's own tokens arrive.

    Verifying a chain accepts its longest prefix that equals what the target commits there (its
    argmax, or its draw at that position), so once the row has committed those tokens by any
    rounds (AR ones included), how much of the chain a verification would have taken is known:
    exactly at T = 0 and with reproducible sampling (a draw is keyed by its position), as a
    sample of the same distribution with independent draws. The planner learns from shadows for
    nothing: its lookup calibration gets the evidence of rounds it never ran, and the ledger
    (`Ledger.credit`) is told what the bet it could not afford would have won.
    `k`: the chain length of that bet (0: none, evidence only); what it would have gained is
    `gain`, this row's share of the batch's, once the row's tokens have shown how much came true."""

    chain: list[int]
    key: tuple  # the lookup calibration's key of the chain (`RowRound.chain_key`)
    k: int = 0
    share: float = 1.0  # 1 / rows of the round it was read in
    spent: float = 0.0  # the bet's predicted time in AR rounds (whole batch)
    seen: int = 0  # chain tokens matched so far
    start: int = 0  # chain tokens a real verification counted already (the rest of an accepted chain)
    credited: bool = False  # the bet's hindsight went to the ledger (once `seen` reached k: its outcome is known)

    def gain(self, accepted: int) -> float:
        """What the bet would have gained, in AR rounds (its row's share): the accepted tokens
        up to k, the bonus, less the row's share of the round's time."""
        return self.share * (min(accepted, self.k) + 1.0 - self.spent)


def follow(chain: list[int], seen: int, committed: list[int]) -> tuple[int, bool]:
    """(tokens of `chain` matched, ended) after `committed` follows the `seen` matched so far:
    ended at the first mismatch or when the whole chain matched.
    Example: follow([4, 9, 2], 1, [9, 7]) -> (2, True); follow([4, 9, 2], 0, [4]) -> (1, False)."""
    for t in committed:
        if seen >= len(chain) or chain[seen] != t:
            return seen, True
        seen += 1
    return seen, seen >= len(chain)
