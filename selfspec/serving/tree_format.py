"""A `selfspec.drafting.tree.Tree` as the EAGLE / SGLang tree-verification tensors, and back. Pure.

SGLang's EAGLE worker verifies a draft tree of q nodes from five per-request tensors, built by
`build_tree_efficient` and read by `VerifyTreeGreedy` in sglang's
sgl-kernel/csrc/speculative/eagle_utils.cu (their spelling is `retrive_*`):

* `candidates[i]`: the token of node i; node 0 is the last verified token (our root), which is
  not in the KV cache yet.
* `retrieve_index[i]`: where node i's target prediction sits in the flattened verify batch
  (`offset + i`; sglang uses `request * q + i`).
* `retrieve_next_token[i]`: node i's first child, -1 for a leaf.
* `retrieve_next_sibling[i]`: the next child of node i's parent, -1 for the last one. sglang's
  builder links children in increasing node index, and so does `to_eagle`.
* `tree_mask[i, j]`: node i attends to node j (j is i or an ancestor of i): the q x q part of
  the attention mask; every node also sees the whole cached prefix.
* `positions[i]`: `seq_len + depth(i)`, the rotary position of node i after `seq_len` cached tokens.

Greedy verification (`greedy_accept`, the semantics of `VerifyTreeGreedy`): start at node 0;
repeatedly follow `retrieve_next_token` from the last accepted node, then `retrieve_next_sibling`
until a node's candidate equals the target's argmax after the last accepted node; accept it; stop
when no child matches. The bonus token is the target's argmax after the last accepted node.

Worked example (root 7; children 11 and 12; 13 under 11), seq_len 5:

    tree:  tokens [7, 11, 12, 13], parents [-1, 0, 0, 1], depths [0, 1, 1, 2]
    candidates            [7, 11, 12, 13]
    retrieve_index        [0, 1, 2, 3]
    retrieve_next_token   [1, 3, -1, -1]     (0's first child is 1; 1's is 3)
    retrieve_next_sibling [-1, 2, -1, -1]    (after 1 comes its sibling 2)
    tree_mask             [[1,0,0,0], [1,1,0,0], [1,0,1,0], [1,1,0,1]]
    positions             [5, 6, 6, 7]
    targets [12, 5, 9, 4] -> from 0 look for 12 among 1, 2 -> accept 2; 2 has no child ->
    accepted [0, 2], bonus 9: the same as `selfspec.drafting.sampling.walk`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.drafting.tree import Tree, ancestors


@dataclass(frozen=True)
class EagleTree:
    candidates: torch.Tensor  # [q] long
    retrieve_index: torch.Tensor  # [q] long
    retrieve_next_token: torch.Tensor  # [q] long, -1 = none
    retrieve_next_sibling: torch.Tensor  # [q] long, -1 = none
    tree_mask: torch.Tensor  # [q, q] bool, ancestor-or-self
    positions: torch.Tensor  # [q] long

    def __post_init__(self):
        q = self.candidates.shape[0]
        for name in ("retrieve_index", "retrieve_next_token", "retrieve_next_sibling", "positions"):
            if tuple(getattr(self, name).shape) != (q,):
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected ({q},)")
        if tuple(self.tree_mask.shape) != (q, q):
            raise ValueError(f"tree_mask has shape {tuple(self.tree_mask.shape)}, expected ({q}, {q})")


def to_eagle(tree: Tree, *, seq_len: int = 0, offset: int = 0) -> EagleTree:
    """The verification tensors of `tree` (see the module docstring for a worked example)."""
    q = len(tree)
    par = tree.parents.tolist()
    next_token = [-1] * q
    next_sibling = [-1] * q
    last_child: dict[int, int] = {}
    for v in range(1, q):  # increasing index: first child is the lowest, siblings ascend
        p = par[v]
        if p in last_child:
            next_sibling[last_child[p]] = v
        else:
            next_token[p] = v
        last_child[p] = v
    return EagleTree(
        candidates=tree.tokens.clone().long(),
        retrieve_index=torch.arange(q, dtype=torch.long) + offset,
        retrieve_next_token=torch.tensor(next_token, dtype=torch.long),
        retrieve_next_sibling=torch.tensor(next_sibling, dtype=torch.long),
        tree_mask=ancestors(tree.parents),
        positions=tree.depths.long() + seq_len,
    )


def from_eagle(t: EagleTree, *, seq_len: int = 0) -> Tree:
    """The `Tree` the tensors describe; ValueError if they do not describe one consistently.

    Parents come from the child links; depths, the mask and the positions must agree with them.
    Example: from_eagle(to_eagle(tree)) has the tree's tokens, parents and depths.
    """
    q = t.candidates.shape[0]
    if q == 0:
        raise ValueError("an EAGLE tree has at least the root node")
    nt, ns = t.retrieve_next_token.tolist(), t.retrieve_next_sibling.tolist()
    parents = [-2] * q
    parents[0] = -1
    for p in range(q):
        c, seen = nt[p], 0
        while c != -1:
            if not 0 < c < q or parents[c] != -2 or seen > q:
                raise ValueError(f"retrieve_next_token/sibling: node {c} (child of {p}) is out of range or linked twice")
            if c < p:
                raise ValueError(f"node {c} is a child of the later node {p}; parents must precede children")
            parents[c], seen = p, seen + 1
            c = ns[c]
    orphans = [v for v in range(q) if parents[v] == -2]
    if orphans:
        raise ValueError(f"nodes {orphans[:8]} are reached by no retrieve_next_token/sibling link")
    for v in range(q):
        if ns[v] != -1 and parents[v] == -1:
            raise ValueError("the root has a retrieve_next_sibling")
    par = torch.tensor(parents, dtype=torch.long)
    depths = torch.zeros(q, dtype=torch.long)
    for v in range(1, q):
        depths[v] = depths[parents[v]] + 1
    if not torch.equal(t.positions.long() - seq_len, depths):
        raise ValueError(f"positions {t.positions.tolist()[:8]}... are not seq_len ({seq_len}) + depth {depths.tolist()[:8]}...")
    if not torch.equal(t.tree_mask.bool(), ancestors(par)):
        raise ValueError("tree_mask is not the ancestor-or-self matrix of the linked tree")
    return Tree(t.candidates.clone().long(), par, depths)


def greedy_accept(t: EagleTree, target_predict: torch.Tensor,
                  num_speculative_tokens: int | None = None) -> tuple[list[int], int]:
    """Accepted node indices (root first) and the bonus token, by the tensors' links alone.

    `target_predict` is indexed by `retrieve_index` (the flattened batch); at most
    `num_speculative_tokens - 1` draft nodes are accepted (sglang's bound; default: no bound).
    Example: the module docstring's tree with targets [12, 5, 9, 4] -> ([0, 2], 9).
    """
    nt, ns = t.retrieve_next_token.tolist(), t.retrieve_next_sibling.tolist()
    cand, ridx, tgt = t.candidates.tolist(), t.retrieve_index.tolist(), target_predict.tolist()
    steps = len(cand) if num_speculative_tokens is None else num_speculative_tokens
    accepted = [0]
    for _ in range(1, steps):
        want = tgt[ridx[accepted[-1]]]
        c = nt[accepted[-1]]
        while c != -1 and cand[c] != want:
            c = ns[c]
        if c == -1:
            break
        accepted.append(c)
    return accepted, tgt[ridx[accepted[-1]]]
