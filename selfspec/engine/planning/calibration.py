"""How likely a drafted node is accepted: online calibration for the planner (`planner.py`), and
the forecast of what a row can draft (`Forecast`: P(accepted) per node, the yields of its top-N).

A tree node's own score (log q + lambda * log rho) is not a probability of acceptance, and a
context-lookup chain has no score at all; both are mapped to acceptance probabilities from
what the verifier actually did in this and earlier generations with the same settings.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch


class Calibrator:
    """P(node accepted | parent accepted) from the node's own score, learnt from this generation.

    Bins over the local log-score (log q + lambda * log rho of the node itself); each bin's
    estimate is (accepted + a * prior) / (reached + a). The scores are not calibrated
    probabilities (lambda * log rho pushes them down), so the prior is an optimistic
    exp(centre / 2): the first rounds try trees, later ones trust what the verifier did. The
    prior weighs half a node: where drafts succeed, a score's prior reads them low (a replayed
    depth-1 node of q 0.95 scores ~-2.2: prior 0.32), and with more weight the first probes'
    evidence left the forecast too low to pay for the next probe.
    Example: 3 nodes of local score ~-0.25 were reached and 1 accepted -> that bin reads
    (1 + 0.5 * exp(-0.125)) / (3 + 0.5) = 0.41.
    """

    EDGES = (-10.0, -8.0, -6.0, -5.0, -4.0, -3.5, -3.0, -2.5, -2.0, -1.5, -1.0, -0.5)

    def __init__(self, prior_weight: float = 0.5):
        self.edges = torch.tensor(self.EDGES, dtype=torch.float64)
        lo = torch.cat([torch.tensor([-12.0], dtype=torch.float64), self.edges])
        hi = torch.cat([self.edges, torch.zeros(1, dtype=torch.float64)])
        self.prior = (0.5 * (lo + hi) / 2).exp()  # optimistic on purpose: untried layouts get tried
        self.a = prior_weight
        self.reached = torch.zeros(len(self.prior), dtype=torch.float64)
        self.accepted = torch.zeros(len(self.prior), dtype=torch.float64)

    def __deepcopy__(self, memo) -> "Calibrator":
        """A planner's fork (once a generation): only the counts change in place; the generic deep
        copy of the tensors was a sizeable share of a short generation on a small model."""
        new = copy.copy(self)
        new.reached, new.accepted = self.reached.clone(), self.accepted.clone()
        return new

    def _bin(self, local_logp: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(local_logp.double().nan_to_num(neginf=-1e9), self.edges)

    FORGET = 0.995  # per update: evidence fades, so the estimate follows the text being written

    def prob(self, local_logp: torch.Tensor) -> torch.Tensor:
        est = (self.accepted + self.a * self.prior) / (self.reached + self.a)
        return est[self._bin(local_logp)]

    def update(self, local_logp: torch.Tensor, reached: torch.Tensor, accepted: torch.Tensor, *,
               fade: bool = True) -> None:
        """Count one verified tree; `fade=False` for the second and later rows of one batched round,
        so that evidence fades per round, not per row."""
        b = self._bin(local_logp)
        if fade:
            self.reached *= self.FORGET
            self.accepted *= self.FORGET
        self.reached.index_add_(0, b, reached.double())
        self.accepted.index_add_(0, b, accepted.double())


class PositionCalibrator:
    """P(the i-th token of a context-lookup chain is accepted | the first i-1 were), per i and per
    length of the n-gram match the chain was copied after (a 3-gram match predicts better), or any
    other key (`Planner` adds how many of the row's latest chains were borne out whole).

    Counts fade by `forget` per update, so what the context does now outweighs what it did
    long ago, and one early miss cannot rule lookup out for good. Plain Python floats: it is
    read every round.
    Example: position 1 reached 4 times and accepted 3 (no fading) -> (3 + 4 * 0.5) / (4 + 4) = 0.62.
    """

    def __init__(self, positions: int = 64, prior: float = 0.5, prior_weight: float = 4.0, forget: float = 0.97):
        self.forget, self.prior, self.a, self.positions = forget, prior, prior_weight, positions
        self.counts: dict[int, tuple[list[float], list[float]]] = {}

    def __deepcopy__(self, memo) -> "PositionCalibrator":
        """A planner's fork: the per-match count lists copied, nothing else changes in place."""
        new = copy.copy(self)
        new.counts = {m: (list(r), list(a)) for m, (r, a) in self.counts.items()}
        return new

    def _get(self, match: int):
        if match not in self.counts:
            self.counts[match] = ([0.0] * self.positions, [0.0] * self.positions)
        return self.counts[match]

    def prob(self, n: int, match=1) -> list[float]:
        reached, accepted = self._get(match)
        a, prior = self.a, self.prior
        return [(accepted[i] + a * prior) / (reached[i] + a) for i in range(min(n, self.positions))]

    def update(self, drafted: int, accepted: int, match=1, *, fade: bool = True, start: int = 0) -> None:
        """A chain of `drafted` tokens of which the first `accepted` were taken; `fade=False` for
        the second and later rows of one batched round (evidence fades per round, not per row);
        `start`: positions before it were counted already (a verified chain's rest, followed in
        hindsight: `Shadow`)."""
        reached_l, accepted_l = self._get(match)
        if fade:
            f = self.forget
            for i in range(self.positions):
                reached_l[i] *= f
                accepted_l[i] *= f
        drafted = min(drafted, self.positions)
        for i in range(start, min(accepted + 1, drafted)):
            reached_l[i] += 1
        for i in range(start, min(accepted, drafted)):
            accepted_l[i] += 1


def walked(tokens: list[int], parents: list[int], committed: list[int]) -> tuple[list[bool], list[bool]]:
    """(reached, accepted) for every non-root node of a tree, from the tokens its row committed
    after the root (greedy: a node is accepted exactly when its parent was and its token is the
    one committed at its depth): a node is reached when its parent was accepted and the row has
    committed a token at its depth. Any round's tokens judge the whole tree this way, the
    nodes it did not verify too (an AR round after a probe judges the probe's depth-1 candidates).
    Example: root 7 with children 4 and 5, 4's child 9; committed [4, 2] -> reached [T, T, T],
    accepted [T, F, F]."""
    n = len(tokens)
    ok = [True] + [False] * (n - 1)
    depth = [0] * n
    reached, accepted = [False] * (n - 1), [False] * (n - 1)
    for v in range(1, n):
        p = parents[v]
        depth[v] = depth[p] + 1
        if ok[p] and depth[v] <= len(committed):
            reached[v - 1] = True
            ok[v] = accepted[v - 1] = tokens[v] == committed[depth[v] - 1]
    return reached, accepted


def local_scores(scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """Each non-root node's score minus its parent's ([n-1]): its own log-probability term."""
    return scores[1:] - scores[parents[1:]]


def acceptance(prob: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """P(v accepted) for every node (root = 1), from per-node conditional probabilities [n-1].

    Parents precede children, so one pass in index order multiplies down each path. Siblings
    exclude each other (one target token per node): their sum is capped at 1.
    Example: chain parents [-1, 0, 1], prob [0.5, 0.5] -> [1, 0.5, 0.25].
    """
    n = parents.shape[0]
    p = torch.ones(n, dtype=torch.float64)
    cond = torch.cat([torch.ones(1, dtype=torch.float64), prob.double()])
    sib = torch.zeros(n, dtype=torch.float64).index_add_(0, parents[1:], cond[1:])
    scale = torch.where(sib > 1, 1 / sib, torch.ones_like(sib))
    par = parents.tolist()
    for v in range(1, n):
        p[v] = p[par[v]] * cond[v] * scale[par[v]]
    return p


@dataclass
class Forecast:
    """What one row can draft this round: P(accepted) per node (None: nothing to draft)."""

    accept: torch.Tensor | list | None = None  # per node of the largest tree (index order); a list: a chain
    parents: torch.Tensor | None = None
    depths: torch.Tensor | None = None
    scores: torch.Tensor | None = None  # path scores: the top-N subtree is the N best (`tree.top_nodes`)
    kind: str = "none"  # "tree": from marginals; "lookup": a context chain; "none"
    _lists: tuple | None = None

    def lists(self) -> tuple[list[float], list[int], list[int], list[int]]:
        """(accept, depths, parents, order) as Python lists; `order` lists the non-root nodes in
        the order `tree.top_nodes` takes them (score descending, shallower first)."""
        if self._lists is None and isinstance(self.accept, list):  # a chain given as plain floats
            n = len(self.accept)
            self._lists = (self.accept, list(range(n)), list(range(-1, n - 1)), list(range(1, n)))
        if self._lists is None:
            acc, dep, par = self.accept.tolist(), self.depths.tolist(), self.parents.tolist()
            sc = None if self.scores is None else self.scores.tolist()
            order = list(range(1, len(acc))) if sc is None else sorted(range(1, len(acc)), key=lambda v: (-sc[v], v))
            self._lists = (acc, dep, par, order)
        return self._lists

    def yields(self, max_depth: int = 10**9) -> list[float]:
        """Expected committed tokens of the top-N subtree (depth <= max_depth), N = 0, 1, ..."""
        if self.accept is None:
            return [1.0]
        acc, dep, _, order = self.lists()  # plain floats: a few dozen nodes, cheaper than tensor ops
        out = [1.0]
        for v in order:
            if dep[v] <= max_depth:
                out.append(out[-1] + acc[v])
        return out

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


def at(ys: list[float], n: int) -> float:
    """ys[n], or its last entry when the draft has fewer than n nodes."""
    return ys[min(n, len(ys) - 1)]


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
