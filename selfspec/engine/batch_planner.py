"""`plan="auto"` for a batch: one layout per round for all rows, the one with the most expected
tokens per second for the whole batch, AR included.

Every row of a round is verified in one forward of R rows x w query tokens, so the batch
shares one width w (`batch.BatchDecoder` pads short drafts). Candidate layouts:

* "ar": w = 1, one certain token per row;
* "lookup/N=k": each row's context-lookup chain (`drafting.lookup`), cut to k tokens, w = k + 1;
  row i's yield is 1 + sum_j prod_{l<=j} p_l(match_i) from a `PositionCalibrator`;
* "linear/two-pass/N=k": a draft pass over [root, M x (B-1)] for every row first (cost
  f(R, B)), then each row's top-1 chain cut to k; the pass is chosen on the yields two-pass
  rounds have had (fading average, optimistic at first), and k after the pass from each chain's
  own scores through a `Calibrator`.

A layout's cost is the batch profile's f(R, w) (`batch_profile.BatchProfile`) times a scale
per kind of round learnt from the measured forwards (the profile was taken at one context
length, under one load), plus a per-row overhead per kind of round, measured. The choice maximises
sum_i E_i / cost, with speculative yields discounted by `MARGIN`. When no prompt waits for a
cache row, the batch ends with its slowest row: a round is then worth the progress of the rows
with the most tokens left (the least any of them is expected to commit), not the sum over rows,
since a speculative round that speeds up only the other rows makes every row pay for the wider
round and leaves the end where it was. After `PROBE_MIN` AR rounds
in a row the best speculative layout is tried anyway (the text may have become predictable);
the interval doubles up to `PROBE_MAX` while such tries lose to AR.

Example (B = 8, CPU-like costs f(8, 1) = 93 ms, f(8, 2) = 124 ms): lookup with one token per
row must expect > 124 / 93 = 1.33 tokens per row to be chosen, i.e. p_1 > 0.35 averaged over
the rows; with a flat (GPU-like) profile any p_1 > 0.05 is enough.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.engine.calibration import Calibrator, PositionCalibrator
from selfspec.engine.layouts import layout_label

MARGIN = 0.05
PROBE_MIN, PROBE_MAX = 8, 128
EMA = 0.2


@dataclass(frozen=True)
class BatchOption:
    """A round's layout for the whole batch: kind "ar" | "lookup" | "two-pass", k draft tokens per row."""

    kind: str = "ar"
    k: int = 0

    @property
    def width(self) -> int:
        return self.k + 1

    @property
    def label(self) -> str:
        if self.kind == "ar" or self.k == 0 and self.kind == "lookup":
            return "ar"
        if self.kind == "lookup":
            return layout_label("lookup", nodes=self.k)
        return layout_label("linear", schedule="two-pass", nodes=self.k)


AR = BatchOption()


@dataclass
class BatchPlanner:
    """See the module docstring. `plan` before a round, `width_after_draft` after a draft pass,
    `observe` after the round."""

    cost: object  # BatchProfile-like: cost(B, q) -> seconds
    lookup_tokens: int = 8
    block_length: int = 16
    two_pass: bool = True
    lookup: PositionCalibrator = field(default_factory=PositionCalibrator)
    chain: Calibrator = field(default_factory=Calibrator)
    two_pass_yield: float = 0.0  # fading average of tokens per row of two-pass rounds; 0: untried
    scale: dict = field(default_factory=dict)  # kind -> measured model time / the profile's prediction
    overhead: dict = field(default_factory=dict)  # kind -> seconds per row-round beyond the model
    ar_streak: int = 0
    probe_every: int = PROBE_MIN
    last_ar_rate: float | None = None  # AR's predicted batch tokens/s at the last plan: what a probe must beat

    def _scale(self, kind: str) -> float:
        """Measured / predicted model time of this kind of round; per kind, because a profile
        taken under other load can be off in its q = 1 to q = 2 step, which only the comparison
        of AR rounds with speculative ones shows. An untried kind borrows AR's."""
        return self.scale.get(kind, self.scale.get("ar", 1.0))

    def _seconds(self, kind: str, R: int, w: int) -> float:
        model = self.cost(R, w)
        if kind == "two-pass":
            model += self.cost(R, self.block_length)
        return model * self._scale(kind) + self.overhead.get(kind, 0.0) * R

    def lookup_gains(self, chains: list[list[int]], matches: list[int], longest: int) -> list[float]:
        """gains[k]: expected accepted drafts of the batch when each row's chain is cut to k
        tokens, k = 0..longest (one pass over each row's calibrated chain)."""
        gains = [0.0] * (longest + 1)
        for chain, match in zip(chains, matches):
            run, total = 1.0, 0.0
            probs = self.lookup.prob(min(longest, len(chain)), match)
            for k in range(1, longest + 1):
                if k <= len(probs):
                    run *= probs[k - 1]
                    total += run
                gains[k] += total
        return gains

    def plan(self, chains: list[list[int]], matches: list[int], room: int, *,
             drain: list[int] | None = None) -> BatchOption:
        """The layout of the next round. `chains[i]`: row i's lookup drafts (may be empty);
        `room`: the most draft tokens any row may still take; `drain`: when no prompt waits, each
        row's tokens left (the round is then worth the progress of the rows with the most left).

        Example (drain): rows with 30, 30 and 12 tokens left, a likely chain on the third row
        only: the rows that end the batch gain nothing from it, so AR is chosen; without `drain`
        the chain's expected tokens count for the batch and lookup may win."""
        R = len(chains)
        longest = min(max((len(c) for c in chains), default=0), self.lookup_tokens, room)
        gains = self.lookup_gains(chains, matches, longest)
        worth, unit = gains, R  # what a round is worth: tokens of the batch, AR's R for sure
        if drain is not None:  # the progress of the rows that end the batch: the least of theirs
            top = max(drain)
            last = [i for i, d in enumerate(drain) if d == top]
            per_row = [self.lookup_gains([chains[i]], [matches[i]], longest) for i in last]
            worth, unit = [min(g[k] for g in per_row) for k in range(longest + 1)], 1
        ar_seconds = self._seconds("ar", R, 1)
        best, best_value = AR, unit / ar_seconds
        spec, spec_value = None, 0.0
        for k in range(1, longest + 1):
            value = (unit + worth[k] * (1 - MARGIN)) / self._seconds("lookup", R, k + 1)
            if value > spec_value:
                spec, spec_value = BatchOption("lookup", k), value
        if self.two_pass and room >= 1:
            k = min(self.block_length - 1, room)
            # untried: optimistic (half the block), so that it gets measured once
            e = self.two_pass_yield or 1 + 0.5 * k
            # every row drafts: the same yield per row
            value = (1 + (e - 1) * (1 - MARGIN)) * unit / self._seconds("two-pass", R, k + 1)
            if value > spec_value:
                spec, spec_value = BatchOption("two-pass", k), value
        if spec is not None and (spec_value > best_value or self.ar_streak >= self.probe_every):
            best = spec
        self.last_ar_rate = R / ar_seconds
        self.ar_streak = self.ar_streak + 1 if best is AR else 0
        return best

    def width_after_draft(self, chains_lq: list[torch.Tensor]) -> int:
        """After a draft pass: how many chain tokens per row to verify (0..longest), from each
        chain's per-token log q through the calibration; the pass itself is already paid."""
        R = len(chains_lq)
        if R == 0:
            return 0
        probs = [torch.cumprod(self.chain.prob(lq), 0).tolist() if lq.numel() else [] for lq in chains_lq]
        longest = max(len(p) for p in probs)
        scale, over = self._scale("two-pass"), self.overhead.get("two-pass", 0.0) * R
        best_k, best_rate = 0, R / (self.cost(R, 1) * scale + over)
        for k in range(1, longest + 1):
            e = R + sum(sum(p[:k]) for p in probs) * (1 - MARGIN)
            rate = e / (self.cost(R, k + 1) * scale + over)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def observe(self, option: BatchOption, *, rows: int, width: int, seconds: float, forward_seconds: float,
                tokens: int, drafted: list[int], accepted: list[int], matches: list[int] | None = None,
                chains_lq: list[torch.Tensor] | None = None) -> None:
        """What a round did: its layout, rows, verify width, wall and model seconds, committed
        tokens, and per row the drafted and accepted counts (lookup: with match lengths; two-pass:
        with each verified chain's log q)."""
        kind = option.kind
        predicted = self.cost(rows, width) + (self.cost(rows, self.block_length) if kind == "two-pass" else 0.0)
        if forward_seconds > 0:
            self.scale[kind] = _ema(self.scale.get(kind), forward_seconds / predicted)
        self.overhead[kind] = _ema(self.overhead.get(kind), max(0.0, seconds - forward_seconds) / max(1, rows))
        if kind == "lookup":  # evidence fades once per round, not once per row
            faded: set[int] = set()
            for n, a, m in zip(drafted, accepted, matches or [1] * len(drafted)):
                if n:
                    self.lookup.update(n, a, m, fade=m not in faded)
                    faded.add(m)
        if kind == "two-pass":
            self.two_pass_yield = _ema(self.two_pass_yield or None, tokens / max(1, rows))
            first = True
            for lq, a in zip(chains_lq or [], accepted):
                n = int(lq.numel())
                if n:
                    reached = torch.zeros(n, dtype=torch.bool)
                    reached[: min(n, a + 1)] = True
                    acc = torch.zeros(n, dtype=torch.bool)
                    acc[:a] = True
                    self.chain.update(lq, reached, acc, fade=first)
                    first = False
        if kind != "ar":  # a speculative round that lost to AR's predicted rate makes the next probe wait longer
            if self.last_ar_rate is not None and seconds > 0:
                won = tokens / seconds >= self.last_ar_rate
                self.probe_every = PROBE_MIN if won else min(PROBE_MAX, 2 * self.probe_every)


def _ema(old: float | None, x: float) -> float:
    """A fading average: the first observation as is, then EMA of each new one."""
    return x if old is None else old + EMA * (x - old)
