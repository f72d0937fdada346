"""Acceptance replay: a real NLD model's draft quality on the stand-in's forwards.

The forward runs exactly as usual (every mask row, LoRA and width paid for), but the draft
marginals it returns are replaced by calibrated synthetic ones built from the reference
continuation (the same prompt's greedy AR output, decoded first and untimed). At depth k the
true token is the top-1 candidate with the profile's probability `top1[k-1]`, else the second
candidate with its share `rank2[k-1]` of the rest, else elsewhere (in the flat tail, never one of
the top-K candidates); the marginals state exactly those probabilities, so they are calibrated.
The target still verifies every draft: greedy output equals AR's whatever the profile.

Each (prompt, output position, depth) draws its own outcome from a generator keyed by the
replay seed, the prompt's tokens and those two numbers, so a layout's tokens per forward does not depend on what other
rounds did (nor on the timings `auto` reads). Depths past a profile's end use its last entry.

A profile is data: a built-in name (`selfspec/data/replay/<name>.json`), a path to such a JSON
file ({"name": ..., "top1": [...], "rank2": [...]}) or a `ReplayProfile`.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import random
import zlib
from dataclasses import dataclass

import torch

from selfspec.drafting.tree import Marginals

PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "replay")
FLOOR = 1e-30  # a stated probability of 0 becomes this: log-scores stay finite


@dataclass(frozen=True)
class ReplayProfile:
    """Per-depth draft quality: `top1[k-1]` = P(the true token at depth k is the top-1
    candidate); `rank2[k-1]` = P(it is the second | it is not the first). The second candidate's
    stated probability (1 - top1) * rank2 may not exceed the first's (it would not be second)."""

    name: str
    top1: tuple[float, ...]
    rank2: tuple[float, ...]

    def __post_init__(self):
        object.__setattr__(self, "top1", tuple(float(x) for x in self.top1))
        object.__setattr__(self, "rank2", tuple(float(x) for x in self.rank2))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("replay profile: name must be a non-empty string")
        if not self.top1 or len(self.top1) != len(self.rank2):
            raise ValueError(f"replay profile {self.name!r}: top1 and rank2 must be non-empty lists of one "
                             f"length, got {len(self.top1)} and {len(self.rank2)}")
        for k, (p, s) in enumerate(zip(self.top1, self.rank2), 1):
            if not (0.0 <= p <= 1.0 and 0.0 <= s <= 1.0):
                raise ValueError(f"replay profile {self.name!r}: depth {k}: probabilities must lie in [0, 1], "
                                 f"got top1 {p}, rank2 {s}")
            if (1 - p) * s > p + 1e-9:
                raise ValueError(f"replay profile {self.name!r}: depth {k}: the second candidate's probability "
                                 f"(1 - {p}) * {s} exceeds the first's {p}; lower rank2 there")

    def at(self, depth: int) -> tuple[float, float]:
        """(top-1, rank-2 share) at depth >= 1; past the end, the last entry."""
        i = min(depth, len(self.top1)) - 1
        return self.top1[i], self.rank2[i]

    def expected_tpf(self, drafts: int) -> float:
        """Tokens a linear chain of `drafts` commits per round (the bonus included), in expectation."""
        out, run = 1.0, 1.0
        for k in range(1, drafts + 1):
            run *= self.at(k)[0]
            out += run
        return out


    def path_prob(self, path: tuple) -> float:
        """The probability that a rank path (0 = top-1, 1 = second, per depth) is the true text's:
        its depths' rates multiplied (draws are independent per depth)."""
        out = 1.0
        for d, r in enumerate(path, 1):
            p1, s = self.at(d)
            out *= p1 if r == 0 else (1.0 - p1) * s
        return out

    def rank_paths(self, nodes: int, max_depth: int) -> list[tuple[tuple, float]]:
        """The `nodes` rank paths up to `max_depth` deep with the most probability, with it, most
        likely first (a path's children come after it): the tree PRESTO's builder aims for."""
        heap, out = [(-self.path_prob((0,)), (0,)), (-self.path_prob((1,)), (1,))], []
        while heap and len(out) < nodes:
            neg, path = heapq.heappop(heap)
            out.append((path, -neg))
            for r in (0, 1) if len(path) < max_depth else ():
                heapq.heappush(heap, (-self.path_prob(path + (r,)), path + (r,)))
        return out

    def expected_tree_tau(self, nodes: int, max_depth: int = 31) -> float:
        """Tokens a round commits (the bonus included), in expectation, when it drafts the best
        tree of `nodes` nodes over the top-2 candidates up to `max_depth` deep (`rank_paths`)."""
        total = 1.0
        for _, p in self.rank_paths(nodes, max_depth):
            total += p
        return total


def builtin_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def load_profile(spec) -> ReplayProfile:
    """A `ReplayProfile` from a built-in name, a JSON file's path, or a profile (returned as is).
    Anything else, an unknown name or a malformed file: one ValueError / TypeError naming it."""
    if isinstance(spec, ReplayProfile):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(f"replay must be a profile name, a JSON file's path or a ReplayProfile, "
                        f"got {type(spec).__name__}")
    spec = os.fspath(spec)
    builtin = os.path.join(PROFILE_DIR, spec + ".json")
    if os.sep not in spec and not spec.endswith(".json") and os.path.isfile(builtin):
        path = builtin
    elif os.path.isfile(spec):
        path = spec
    else:
        raise ValueError(f"unknown replay profile {spec!r}: not a built-in ({', '.join(builtin_profiles())}) "
                         f"and no such file")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"replay profile {path}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or not {"top1", "rank2"} <= set(data):
        raise ValueError(f"replay profile {path}: expected an object with 'top1' and 'rank2' lists (and 'name')")
    if not all(isinstance(data[k], list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                 for x in data[k]) for k in ("top1", "rank2")):
        raise ValueError(f"replay profile {path}: 'top1' and 'rank2' must be lists of numbers")
    name = data.get("name", os.path.splitext(os.path.basename(path))[0])
    return ReplayProfile(name, tuple(data["top1"]), tuple(data["rank2"]))


class Replay:
    """The engine's collaborator: `marginals(marg, row, at, depth)` returns the replayed
    marginals for a row whose marginal row i stands for output position `at + i` at draft depth
    `depth + i` (`references[row]`: that row's reference continuation; `prompts[row]`: its
    prompt, which keys its draws so that prompts do not share one pattern of outcomes)."""

    def __init__(self, profile: ReplayProfile, references: dict[int, list[int]], prompts: dict[int, list[int]], *,
                 mask_id: int, top_k: int, seed: int = 0):
        self.profile, self.references = profile, references
        self.keys = {i: zlib.crc32(str(p).encode()) for i, p in prompts.items()}
        self.mask_id, self.top_k, self.seed = mask_id, max(2, top_k), seed

    @property
    def name(self) -> str:
        return self.profile.name

    def label(self) -> str:
        return f"replayed acceptance (profile {self.profile.name})"

    def marginals(self, marg: Marginals, row: int, at: int, depth: int) -> Marginals:
        ref = self.references.get(row, [])
        V = marg.logq.shape[-1] if marg.logq is not None else None
        if V is None:
            raise ValueError("replay needs the whole log-marginal (Marginals.logq)")
        D, K = len(marg), min(self.top_k, V - 1)
        top_tok = torch.empty(D, K, dtype=torch.long)
        top_lq = torch.empty(D, K)
        tails = []
        for i in range(D):
            true = ref[at + i] if 0 <= at + i < len(ref) else None
            toks, p1, p2, tail = self._depth(row, at + i, depth + i, true, V, K)
            top_tok[i] = torch.tensor(toks)
            top_lq[i] = torch.tensor([p1, p2] + [tail] * (K - 2)).clamp_min(FLOOR).log()
            tails.append(math.log(max(tail, FLOOR)))
        logq = torch.tensor(tails, dtype=torch.float32)[:, None].expand(D, V).clone()
        logq.scatter_(1, top_tok, top_lq)
        logq[:, self.mask_id] = float("-inf")
        logq = logq.to(marg.logq.device)
        ent = None
        if marg.entropy is not None:
            ent = -(logq.exp() * logq.nan_to_num(neginf=0.0)).sum(-1).cpu()
        return Marginals(top_lq, top_tok, logq, ent)

    def outcome(self, row: int, pos: int, depth: int) -> int:
        """Where the true token at output position `pos` stands in the draft at `depth`: 0 top-1,
        1 second, 2 elsewhere (also past the reference's end)."""
        ref = self.references.get(row, [])
        return self._draw(row, pos, depth)[1] if 0 <= pos < len(ref) else 2

    def linear_commits(self, row: int, emitted: int, drafts: int) -> int:
        """Tokens a one-pass linear round commits (its accepted drafts and the bonus) when
        `emitted` tokens are out and it drafts `drafts`: its first draft, output position
        `emitted`, stands at depth 1 (the previous round's group knows the root)."""
        d = 0
        while d < drafts and self.outcome(row, emitted + d, d + 1) == 0:
            d += 1
        return d + 1

    def linear_tpf(self, row: int, *, new_tokens: int, block: int) -> tuple[int, int]:
        """(tokens, rounds) of replayed one-pass linear self-speculation at `block` over an
        answer of `new_tokens` (the first comes with the prefill), walked from the draws alone:
        what a replayed run of the model commits, without running it."""
        emitted, rounds = 1, 0
        while emitted < new_tokens:
            emitted += min(self.linear_commits(row, emitted, block - 1), new_tokens - emitted)
            rounds += 1
        return emitted - 1, rounds

    def _draw(self, row: int, pos: int, depth: int):
        p1, s = self.profile.at(depth)
        rng = random.Random(f"{self.seed}:{self.keys.get(row, row)}:{pos}:{depth}")
        u = rng.random()
        return rng, 0 if u < p1 else 1 if u < p1 + (1.0 - p1) * s else 2

    def _depth(self, row: int, pos: int, depth: int, true: int | None, V: int, K: int):
        """One depth's K candidates and their stated probabilities: the true token placed by the
        profile's odds, the other places random wrong tokens (never the mask, never repeated)."""
        p1, s = self.profile.at(depth)
        p2 = (1.0 - p1) * s
        rng, outcome = self._draw(row, pos, depth)
        if true is None:
            outcome = 2
        taken = {self.mask_id} | ({true} if true is not None else set())
        toks = []
        while len(toks) < K:
            t = rng.randrange(V)
            if t not in taken:
                taken.add(t)
                toks.append(t)
        if outcome < 2:
            toks[outcome] = true
        # the rest of the mass, flat over the other tokens (the mask, top-1 and top-2 aside)
        return toks, p1, p2, max(0.0, 1.0 - p1 - p2) / max(1, V - 3)
