"""Tree verification walk and oracle acceptance: pure functions over plain lists/tensors.

`targets[v]` is the target's token after node v's path (argmax, or one exact sample drawn per
node with the generator). Walking from the root, a child is accepted iff it carries the target
token of its parent; the target token at the last accepted node is the bonus. Because the draw
at a node is independent of whether the walk reaches it, the emitted tokens are exact samples.
"""

from __future__ import annotations

import torch

from selfspec.drafting.tree import Tree


def walk(tree: Tree, targets: torch.Tensor) -> tuple[list[int], int]:
    """Accepted node path (root first) and the bonus token.

    Example: tokens [7, 11, 12, 13], parents [-1, 0, 0, 1], targets [12, 5, 9, 4]:
    root 7 -> target 12 -> child node 2 carries 12, accepted -> its target 9 matches no child,
    so the path is [0, 2] and the bonus is 9 (two tokens emitted: 12, 9).
    """
    if tree.tokens.shape[0] == 1:  # the root alone (every AR round): its target is the bonus
        return [0], int(targets[0])
    tok, par, tgt = tree.tokens.tolist(), tree.parents.tolist(), targets.tolist()
    children: dict[int, dict[int, int]] = {}
    for v in range(1, len(tok)):
        children.setdefault(par[v], {}).setdefault(tok[v], v)
    path = [0]
    while True:
        nxt = children.get(path[-1], {}).get(tgt[path[-1]])
        if nxt is None:
            return path, tgt[path[-1]]
        path.append(nxt)


def oracle_length(candidates: torch.Tensor, continuation: list[int]) -> int:
    """Tokens a perfect tree inside the candidate space would commit in that round.

    candidates [D, K]: the top-k draft tokens per depth; continuation: the tokens actually
    emitted after the root (from this round on). The oracle accepts depth d while the emitted
    token there is among the candidates, then adds the bonus.
    Example: candidates [[3, 4], [5, 6]], continuation [4, 9, 1] -> depth 1 ok, depth 2 fails
    -> 1 accepted + bonus = 2.
    """
    n = 0
    for d in range(min(candidates.shape[0], len(continuation))):
        if continuation[d] not in candidates[d].tolist():
            break
        n += 1
    return min(n + 1, max(len(continuation), 1))


def truncate(tokens: list[int], eos: set[int], room: int) -> tuple[list[int], bool]:
    """A round's committed tokens cut at the first eos (kept) and at `room`; (chunk, hit eos).

    Example: truncate([5, 2, 7], eos={2}, room=8) -> ([5, 2], True); truncate([5, 6, 7], {2}, 2) -> ([5, 6], False).
    """
    out = []
    for t in tokens[:room]:
        out.append(t)
        if t in eos:
            return out, True
    return out, False
