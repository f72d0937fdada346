"""`Stats`: what one generation measured (returned as a value, never printed).

tau and TPF are defined here once; `Stats.total` sums runs, and the bench aggregates through it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Stats:
    """Measurements of one generation (returned as a value, never printed); `total` sums runs."""

    new_tokens: int = 0
    rounds: int = 0
    forwards: int = 0  # decode forwards, prefill excluded (a two-pass round counts both passes)
    prefill_forwards: int = 0
    round_tokens: int = 0  # tokens committed by verification rounds (prefill's first token excluded)
    accept_lengths: list[int] = field(default_factory=list)
    oracle_lengths: list[int] = field(default_factory=list)
    forward_seconds: float = 0.0
    tree_seconds: float = 0.0  # drafting: turning marginals into the chain / tree
    seconds: float = 0.0
    query_tokens: int = 0  # query tokens run by decode forwards (tree nodes + mask slots)
    plan_hist: Counter = field(default_factory=Counter)  # round layout -> rounds
    replay: str | None = None  # the replay profile's name: acceptance replayed, not the model's own
    replay_seconds: float = 0.0  # building the replayed marginals (within `seconds`, outside the forward)

    @property
    def tau(self) -> float:
        return self.round_tokens / self.rounds if self.rounds else 0.0

    @property
    def tpf(self) -> float:
        return self.round_tokens / self.forwards if self.forwards else 0.0

    @property
    def oracle_tau(self) -> float | None:
        return sum(self.oracle_lengths) / len(self.oracle_lengths) if self.oracle_lengths else None

    @classmethod
    def total(cls, runs: list["Stats"]) -> "Stats":
        out = cls()
        for s in runs:
            for k in ("new_tokens", "rounds", "forwards", "prefill_forwards", "round_tokens", "forward_seconds",
                      "tree_seconds", "seconds", "query_tokens", "replay_seconds"):
                setattr(out, k, getattr(out, k) + getattr(s, k))
            out.accept_lengths += s.accept_lengths
            out.oracle_lengths += s.oracle_lengths
            out.plan_hist.update(s.plan_hist)
        out.replay = runs[0].replay if runs and all(s.replay == runs[0].replay for s in runs) else None
        return out

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "forwards": self.forwards,
            "query_tokens": self.query_tokens,
            "prefill_forwards": self.prefill_forwards,
            "tau": round(self.tau, 4),
            "tpf": round(self.tpf, 4),
            "oracle_tau": None if self.oracle_tau is None else round(self.oracle_tau, 4),
            "accept_hist": dict(sorted(Counter(self.accept_lengths).items())),
            "plan_hist": dict(self.plan_hist.most_common()),
            "seconds": round(self.seconds, 4),
            "forward_seconds": round(self.forward_seconds, 4),
            "other_seconds": round(self.seconds - self.forward_seconds, 4),
            "tree_seconds": round(self.tree_seconds, 4),
            "overhead_share": round(1 - self.forward_seconds / self.seconds, 4) if self.seconds else 0.0,
            "tokens_per_second": round(self.new_tokens / self.seconds, 2) if self.seconds else 0.0,
            "replay": self.replay,
            "replay_seconds": round(self.replay_seconds, 4),
        }
