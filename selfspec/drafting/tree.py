"""Draft trees as plain data, and the priority-based construction that builds them.

A tree is three equal-length tensors: `tokens`, `parents` (-1 for the root) and `depths`. Nodes
are stored in breadth-first order (every parent precedes its children), node 0 is the root: the
exact token the previous round emitted, which is not in the KV cache yet. A linear draft is a
degenerate tree (a chain).

Example (root 7, two candidates at depth 1, one child under the first):

    tokens  = [7, 11, 12, 13]
    parents = [-1, 0, 0, 1]
    depths  = [0, 1, 1, 2]
    paths: 7 -> 11 -> 13 and 7 -> 12
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from selfspec.drafting.sampling import NEG, ban_token, process_logits
from selfspec.drafting.scoring import Expansion, ScoreFn


@dataclass(frozen=True)
class Tree:
    tokens: torch.Tensor  # [n] long
    parents: torch.Tensor  # [n] long, -1 for the root
    depths: torch.Tensor  # [n] long
    scores: torch.Tensor | None = None  # [n] path scores from construction (root 0), if known

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if len(self) else 0


@dataclass(frozen=True)
class Marginals:
    """The diffusion marginals a tree is drafted from, for depths 1..D after the root.

    `top_lq` / `top_tok` [D, K]: the K best log q per depth and their tokens (CPU); `logq`
    [D, V]: the whole log-marginal (mask id removed), on the model's device, for scoring tokens
    outside the top K; `entropy` [D] or None.
    """

    top_lq: torch.Tensor
    top_tok: torch.Tensor
    logq: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.top_tok.shape[0])

    @classmethod
    def from_logits(cls, logits: torch.Tensor, k: int, banned: int | None, *, entropy: bool = False) -> "Marginals":
        """Diffusion logits [D, V] (unshifted: row d is the token at depth d) -> Marginals."""
        lq = ban_token(logits, banned).log_softmax(-1)
        vals, toks = lq.topk(min(k, lq.shape[-1]), dim=-1)
        ent = -(lq.exp() * lq.nan_to_num(neginf=0.0)).sum(-1).cpu() if entropy else None
        return cls(vals.cpu(), toks.cpu(), lq, ent)

    def coupled(self, noise: torch.Tensor, k: int, *, temperature: float, top_k: int = 0,
                top_p: float = 1.0) -> "Marginals":
        """The marginals as the coupled drafter reads them: per depth the draft distribution
        filtered and tempered like the target's, plus the Gumbel noise of the position that depth
        stands for (`noise` [D', V], D' <= D), renormalised. Its top token is the draft's
        Gumbel-max draw under the target's own noise, so where draft and target agree, it is the
        target's token; the others are the next likeliest under that noise.

        Example: q = [.6, .4] and noise [0, 2]: the perturbed scores favour token 1, which the
        target also draws where it holds q."""
        d = min(len(self), noise.shape[0])
        x = process_logits(self.logq[:d], temperature=temperature, top_k=top_k, top_p=top_p).double()
        lq = (x + noise[:d].to(x.device)).log_softmax(-1).float()
        vals, toks = lq.topk(min(k, lq.shape[-1]), dim=-1)
        return Marginals(vals.cpu(), toks.cpu(), lq, None if self.entropy is None else self.entropy[:d])


def root_only(token: int) -> Tree:
    z = torch.zeros(1, dtype=torch.long)
    return Tree(torch.tensor([token]), z - 1, z)


def chain(tokens: list[int] | torch.Tensor, scores: torch.Tensor | None = None) -> Tree:
    """A linear draft: node i is the child of node i-1. chain([5, 6, 7]) has parents [-1, 0, 1]."""
    t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    n = t.shape[0]
    return Tree(t, torch.arange(n) - 1, torch.arange(n), scores)


def ancestors(parents: torch.Tensor) -> torch.Tensor:
    """Ancestor-or-self matrix [n, n] (bool): row v is True at v and every ancestor of v.

    Requires parents to precede children. Each node's set is its parent's plus itself, kept as
    one Python integer's bits and unpacked once: a tree of n nodes costs n integer ors and a few
    tensor ops (a step per depth of tensor ops cost a few percent of a round for a lookup chain
    of 8). Example: parents [-1, 0, 0, 1] -> row 3 is [T, T, F, T].
    """
    sets = ancestor_sets(parents.tolist())
    return unpack_bits(sets, len(sets))


def ancestor_sets(parents: list[int]) -> list[int]:
    """Node v's ancestors and itself as the bits of one integer (bit u = node u), parents first:
    ancestor_sets([-1, 0, 0, 1]) == [0b1, 0b11, 0b101, 0b1011]."""
    sets: list[int] = []
    for v, p in enumerate(parents):
        sets.append((sets[p] if p >= 0 else 0) | (1 << v))
    return sets


def unpack_bits(sets: list[int], n: int) -> torch.Tensor:
    """Bit sets (Python integers) -> bool [len(sets), n], column j = bit j. unpack_bits([5], 3) ->
    [[T, F, T]]. Sixty-two bits a pass: the int64 shifts never touch the sign bit."""
    parts = []
    for lo in range(0, n, 62):
        w = min(62, n - lo)
        word = torch.tensor([(s >> lo) & ((1 << w) - 1) for s in sets], dtype=torch.long)
        parts.append((word[:, None] >> torch.arange(w)) & 1)
    if not parts:
        return torch.zeros(len(sets), 0, dtype=torch.bool)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, 1)).bool()


def path_to(parents: torch.Tensor | list[int], v: int) -> list[int]:
    """Node indices from the root to v: path_to([-1, 0, 0, 1], 3) == [0, 1, 3]."""
    par = parents.tolist() if isinstance(parents, torch.Tensor) else parents
    out = []
    while v >= 0:
        out.append(v)
        v = par[v]
    return out[::-1]


@dataclass(frozen=True)
class ContextCandidates:
    """Per-path candidates beyond q's top-K: what the context predicts after each path.

    Under p*(t | c_d) ~ q_d(t) * rho(t | c_d)^lambda with a context rho, the tokens that can win
    are q_d's top-K plus the context's continuations of that path, so the builder asks
    `propose(context)` (the last committed tokens, then the path's tokens) for up to `width`
    tokens under each of the `paths` best frontier nodes of a depth, and scores them with the
    full marginal `logq` [D, V] and the same rho as the top-K.
    """

    propose: Callable[[list[int]], list[int]]
    logq: torch.Tensor
    context: tuple[int, ...]
    width: int = 2
    paths: int = 4


def build_tree(root: int, top_lq: torch.Tensor, top_tok: torch.Tensor, *, budget: int,
               extra_score: ScoreFn | None = None, history: tuple[int, int] | None = None,
               max_depth: int | None = None, entropy: torch.Tensor | None = None,
               lookup: ContextCandidates | None = None) -> Tree:
    """Priority-based construction: the `budget` best draft nodes under the root, by path score.

    top_lq / top_tok [D, K] are the top-K log marginals and their tokens for depths 1..D
    (`logq.topk(K)`), so the candidate space is K tokens per depth. A child t at depth d under a node with
    path score S gets S + log q_d(t) + extra_score(expansion) (see `Expansion`; the history
    tokens are the context, then the path), where extra_score is lambda * log rho (<= 0).
    Scores never increase along a path, so the global top-`budget` set is prefix-closed; ties
    prefer shallower nodes. Beam search with a beam of `budget` per depth and global retention
    finds exactly that set: every member's ancestors are members, at most `budget` per depth.

    Example: q = [[.6, .3, .1], [.9, .05, .05]] (D=2, V=3), K=2, budget 2, no extra score:
        candidate paths 0 (.6), 1 (.3), 0->0 (.54), 1->0 (.27), ... -> keeps 0 and 0->0.
    With `lookup` whose context continues "0" by token 2: under node 0 the candidates at depth
    2 are 0, 1 (top-K) and 2 (.6 * .05 = .03), each scored the same way.

    One loop serves both: context candidates are `width` more columns per frontier node whose
    log q comes from the full marginal instead of the top-K; absent ones (-1) score -inf, and a
    candidate scoring -inf (probability 0) never becomes a node.
    """
    if lookup is not None and extra_score is not None and not hasattr(extra_score, "tokens"):
        raise ValueError("context candidates need a token-level rho (ngram or none), not a feature-level one")
    depth_cap = top_tok.shape[0] if max_depth is None else min(max_depth, top_tok.shape[0])
    if budget < 1 or depth_cap < 1:
        return root_only(root)
    k = top_tok.shape[1]
    score = _Scorer(extra_score, lookup, top_lq[:depth_cap], top_tok[:depth_cap], root,
                    history[0] if history is not None else -1, None if entropy is None else entropy[:depth_cap])
    front = _Frontier.at_root(root, score.h2, lookup)
    nodes = [(torch.tensor([root]), torch.tensor([-1]), torch.tensor([0]), torch.tensor([0.0]))]
    count, kth_best = 1, None
    for d in range(1, depth_cap + 1):
        p = front.idx.shape[0]
        child_tok, lq = top_tok[d - 1].expand(p, k), top_lq[d - 1].expand(p, k)
        if lookup is not None:
            child_tok, lq = _with_context(lookup, d, child_tok, lq, front.score, front.ctx)
        extra = score(d, front, child_tok, lq)
        child = (front.score[:, None] + (lq if extra is None else lq + extra)).reshape(-1)
        if kth_best is not None and float(child.max()) <= kth_best:
            break  # nothing deeper can enter the global top set
        vals, keep = torch.topk(child, min(budget, child.shape[0]))  # sorted: -inf ones come last
        if float(vals[-1]) == NEG:
            keep, vals = keep[vals > NEG], vals[vals > NEG]
            if keep.numel() == 0:
                break
        parent_slot, col = keep // child_tok.shape[1], keep % child_tok.shape[1]
        kept_tok = child_tok.reshape(-1)[keep]
        nodes.append((kept_tok, front.idx[parent_slot], torch.full((keep.shape[0],), d), vals))
        front = front.advance(score, lookup, count, parent_slot, col, kept_tok, lq.reshape(-1)[keep], vals)
        count += keep.shape[0]
        if count - 1 >= budget:
            kth_best = float(torch.topk(torch.cat([n[3] for n in nodes[1:]]), budget).values[-1])
    tokens, parents, depths, scores = (torch.cat(part) for part in zip(*nodes))
    # nodes were appended depth by depth, so index order is depth order: `top_nodes`' stable
    # sort keeps the global top-`budget` with the tie rule, prefix-closed
    return top_nodes(Tree(tokens, parents, depths, scores), budget)


class _Scorer:
    """How a tree's extra score (lambda * log rho) is read, chosen once per tree: a per-tree table
    (every (w2, w1, t) of the top-K grid) gathered by the frontier's top-K columns; once context
    candidates exist a path can leave that grid, so a token-level rho scores (w2, w1, t)
    directly; a score with neither is called per step with the whole `Expansion`."""

    def __init__(self, extra_score, lookup, top_lq, top_tok, root: int, h2: int, entropy):
        self.h2, self.entropy = h2, entropy
        self.table = self.by_tokens = self.by_expansion = None
        if extra_score is not None and lookup is not None:
            self.by_tokens = extra_score.tokens
        elif hasattr(extra_score, "table"):
            self.table = extra_score.table(top_lq, top_tok, root, h2, entropy)
        elif extra_score is not None:
            self.by_expansion, self.ranks = extra_score, torch.arange(top_tok.shape[1], dtype=torch.float32)

    @property
    def reads_tokens(self) -> bool:
        return self.by_tokens is not None or self.by_expansion is not None

    def __call__(self, d: int, f: "_Frontier", child_tok: torch.Tensor, lq: torch.Tensor):
        p, width = child_tok.shape
        if self.table is not None:
            return self.table[d - 1][f.i2, f.i1]
        if self.by_tokens is not None:
            return self.by_tokens(f.w2[:, None].expand(p, width), f.w1[:, None].expand(p, width),
                                  child_tok.clamp(min=0), d)
        if self.by_expansion is not None:
            return self.by_expansion(Expansion(
                d, f.w2[:, None].expand(p, width), f.w1[:, None].expand(p, width), child_tok, lq,
                self.ranks.expand(p, width), f.lq[:, None].expand(p, width), f.rank[:, None].expand(p, width),
                None if self.entropy is None else float(self.entropy[d - 1])))
        return None


@dataclass
class _Frontier:
    """The nodes retained at the current depth: their indices and path scores, and what scoring
    the next depth reads about them (the last two tokens of each path, their top-K columns, each
    node's own log q and rank, the context after each path)."""

    idx: torch.Tensor
    score: torch.Tensor
    w2: torch.Tensor
    w1: torch.Tensor
    i2: torch.Tensor
    i1: torch.Tensor
    lq: torch.Tensor
    rank: torch.Tensor
    ctx: list | None

    @classmethod
    def at_root(cls, root: int, h2: int, lookup) -> "_Frontier":
        z = torch.zeros(1, dtype=torch.long)
        return cls(torch.tensor([0]), torch.zeros(1), torch.tensor([h2]), torch.tensor([root]), z, z, torch.zeros(1),
                   torch.full((1,), -1.0), [tuple(lookup.context)] if lookup is not None else None)

    def advance(self, score: _Scorer, lookup, start: int, parent_slot, col, kept_tok, kept_lq, vals) -> "_Frontier":
        """The frontier of the kept children (only what this tree's score reads is updated)."""
        f = _Frontier(torch.arange(start, start + kept_tok.shape[0]), vals, self.w2, self.w1, self.i2, self.i1,
                      self.lq, self.rank, self.ctx)
        if score.reads_tokens:
            f.w2, f.w1 = self.w1[parent_slot], kept_tok
        if score.by_expansion is not None:
            f.lq, f.rank = kept_lq, col.float()
        if score.table is not None:
            f.i2, f.i1 = self.i1[parent_slot], col
        if lookup is not None:
            n_ctx = len(lookup.context)
            f.ctx = [(self.ctx[j] + (t,))[-n_ctx:] for j, t in zip(parent_slot.tolist(), kept_tok.tolist())]
        return f


def _with_context(lookup: ContextCandidates, d: int, child_tok: torch.Tensor, lq: torch.Tensor,
                  f_score: torch.Tensor, f_ctx: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-K columns [P, K] plus `lookup.width` context columns: what the context continues
    each of the `lookup.paths` best frontier paths with (tokens not already in the top-K), their
    log q read from the full marginal; -1 / -inf where a path has fewer continuations."""
    p = child_tok.shape[0]
    top = set(child_tok[0].tolist())
    ext = torch.full((p, lookup.width), -1, dtype=torch.long)
    for i in torch.argsort(-f_score, stable=True)[: lookup.paths].tolist():
        extra = [t for t in dict.fromkeys(lookup.propose(list(f_ctx[i]))) if t not in top][: lookup.width]
        ext[i, : len(extra)] = torch.tensor(extra, dtype=torch.long)
    ext_lq = lookup.logq[d - 1][ext.clamp(min=0).to(lookup.logq.device)].float().cpu()
    return torch.cat([child_tok, ext], 1), torch.cat([lq, ext_lq.masked_fill(ext < 0, NEG)], 1)


def top_nodes(tree: Tree, n: int) -> Tree:
    """The root and the `n` best nodes by path score (ties: shallower first), in index order.

    Scores never increase along a path, so the result is prefix-closed; on a tree made by
    `build_tree(budget=B)` it equals `build_tree(budget=n)` for every n <= B.
    Example: scores [0, -1, -3, -2] with parents [-1, 0, 0, 1] and n = 2 keeps nodes 0, 1, 3.
    """
    if n >= len(tree) - 1:
        return tree
    order = torch.argsort(-tree.scores[1:], stable=True)[:n] + 1
    keep = torch.cat([torch.zeros(1, dtype=torch.long), order.sort().values])
    remap = torch.full((len(tree) + 1,), -1, dtype=torch.long)
    remap[keep] = torch.arange(keep.shape[0])
    return Tree(tree.tokens[keep], remap[tree.parents[keep]], tree.depths[keep], tree.scores[keep])


def group_owners(tree: Tree, limit: int | None) -> torch.Tensor:
    """The nodes that get a mask group in a one-pass round: all, or the `limit` likeliest endpoints.

    A node's endpoint mass is P(reach v) - sum of P(reach c) over its children, with
    P(reach v) = exp(path score). The root always gets a group, so every endpoint has an
    ancestor-or-self with a group (the runtime falls back to the nearest one).
    Example: chain scores [0, -0.1, -2.0] (P = 1, .90, .14), limit 2 -> masses [.10, .77, .14]
    -> owners [0, 1].
    """
    n = len(tree)
    if limit is None or limit >= n or tree.scores is None:
        return torch.arange(n)
    reach = tree.scores.float().exp()
    child_mass = torch.zeros(n).index_add_(0, tree.parents[1:], reach[1:])
    mass = (reach - child_mass).clamp(min=0)
    mass[0] = float("inf")
    return torch.topk(mass, max(1, limit)).indices.sort().values


def nearest_owner(parents: torch.Tensor, owners: torch.Tensor, v: int) -> tuple[int, int]:
    """(group index, owner node) of v's nearest ancestor-or-self that owns a group."""
    slot = {int(o): j for j, o in enumerate(owners.tolist())}
    par = parents.tolist()
    while v not in slot:
        v = par[v]
    return slot[v], v


def is_prefix_closed(tree: Tree) -> bool:
    par = tree.parents.tolist()
    return par[0] == -1 and all(0 <= p < i for i, p in enumerate(par) if i > 0)
