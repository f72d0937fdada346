"""Pure builders of float additive attention masks (0 = attend, -inf = blocked).

Every mask here is a float tensor: boolean masks are silently wrong under eager attention.
Builders take plain index tensors and return masks without touching a model, so a serving
engine can lift them unchanged and tests can check them against brute force.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.drafting.tree import ancestor_sets, unpack_bits

NEG = float("-inf")


def additive(allowed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Bool `allowed` [..., q, k] -> float additive mask of the same shape."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, NEG)


def joint_training_allowed(n: int, block: int, offset: int = 0) -> torch.Tensor:
    """Allowed-attention matrix [2n, 2n] for the joint AR + diffusion objective.

    The input is [x_t (noisy) | x_0 (clean)], both at positions 0..n-1, blocks
    blk(i) = (i + offset) // block. Noisy -> noisy: same block; noisy -> clean: strictly earlier
    block; clean -> clean: causal; clean never sees noisy.

    Example: n=4, block=2, offset=1 gives blocks [0, 1, 1, 2]; noisy token 1 sees noisy 1, 2 and
    clean 0; clean token 2 sees clean 0, 1, 2.
    """
    i = torch.arange(n)
    blk = (i + offset) // block
    same = blk[:, None] == blk[None, :]
    earlier = blk[None, :] < blk[:, None]
    causal = i[None, :] <= i[:, None]
    top = torch.cat([same, earlier], dim=1)
    bottom = torch.cat([torch.zeros(n, n, dtype=torch.bool), causal], dim=1)
    return torch.cat([top, bottom], dim=0)


@dataclass(frozen=True)
class Layout:
    """One forward's queries: tree nodes first, then one mask group per owner node.

    `mask` [1, 1, q, prefix_len + q] float additive; `positions` [1, q]; group j occupies query
    rows n + j*G .. n + (j+1)*G - 1 and is owned by tree node `owners[j]`.
    """

    mask: torch.Tensor
    positions: torch.Tensor
    n_nodes: int
    owners: torch.Tensor
    group_size: int

    def group_rows(self, j: int) -> slice:
        start = self.n_nodes + j * self.group_size
        return slice(start, start + self.group_size)


def tree_block(parents: torch.Tensor, depths: torch.Tensor, owners: torch.Tensor | None = None,
               group_size: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of a round's mask that is not "see the whole prefix": [q, q] among the new tokens.

    Returns (block, offsets): `block` float additive over the q = n + m*G new tokens (tree nodes,
    then one group of G masks per owner), `offsets` their positions relative to the prefix length.
    Node v sits at offset depth(v) and sees its ancestors and itself; group j (owned by node u)
    sits at offsets depth(u) + 1 .. depth(u) + G and sees u's ancestors, u and its own group.
    Every new token also sees the whole prefix, which is why the prefix needs no mask columns.

    Example: chain [-1, 0] with one group of G=2 on node 1. Allowed (n0 n1 | g0 g1), offsets
    [0, 1, 2, 3]:
        n0: 1 0 | 0 0
        n1: 1 1 | 0 0
        g0: 1 1 | 1 1
        g1: 1 1 | 1 1
    """
    n = parents.shape[0]
    G = group_size if owners is not None and owners.shape[0] else 0
    sets, offsets = row_sets(parents.tolist(), depths.tolist(), owners.tolist() if G else [], G, n, 0)
    return additive(unpack_bits(sets, len(sets)), dtype), torch.tensor(offsets)


def row_sets(parents: list[int], depths: list[int], owners: list[int], group: int, start: int,
             width: int) -> tuple[list[int], list[int]]:
    """One row's queries as bit sets of the columns each may see, and their offsets: the tree's
    n nodes in columns 0..n-1, its mask groups of `group` from column `start` on, padding to
    `width` columns (a padding column sees only itself and sits at its own column's offset).
    Example: chain [-1, 0], one group of 2 on node 1, start 3, width 5 -> sets [0b1, 0b11,
    0b100, 0b11011, 0b11011], offsets [0, 1, 2, 2, 3]."""
    sets = ancestor_sets(parents)
    offsets = list(depths)
    for c in range(len(sets), start):  # padding between the nodes and the groups
        sets.append(1 << c)
        offsets.append(c)
    for j, u in enumerate(owners):
        own = sets[u] | (((1 << group) - 1) << (start + j * group))
        sets.extend([own] * group)
        offsets.extend(range(depths[u] + 1, depths[u] + 1 + group))
    for c in range(len(sets), width):
        sets.append(1 << c)
        offsets.append(c)
    return sets, offsets


def tree_and_groups(prefix_len: int, parents: torch.Tensor, depths: torch.Tensor,
                    owners: torch.Tensor | None = None, group_size: int = 0,
                    dtype: torch.dtype = torch.float32) -> Layout:
    """The full [1, 1, q, prefix_len + q] mask of a round: `tree_block` plus prefix columns of 0.

    The runtime never builds this (its forward keeps the prefix columns in a reused zero
    buffer); it is the whole picture for tests, pictures and engines that want one tensor.
    Example: prefix 2, chain [-1, 0], one group of G=2 on node 1 -> rows as in `tree_block`
    with two leading columns of 1, positions [2, 3, 4, 5].
    """
    block, offsets = tree_block(parents, depths, owners, group_size, dtype)
    q = block.shape[0]
    owners = torch.zeros(0, dtype=torch.long) if owners is None else owners.long()
    mask = torch.cat([torch.zeros(q, prefix_len, dtype=dtype), block], 1)
    G = group_size if owners.shape[0] else 0
    return Layout(mask[None, None], (prefix_len + offsets)[None], parents.shape[0], owners, G)


@dataclass
class RowsLayout:
    """One round's queries for R rows: tokens / offsets [R, q], blocks [R, q, q] (None when q = 1:
    one token per row sees its prefix, no mask to build); row i's groups start at column `nodes`."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    blocks: torch.Tensor | None
    nodes: int  # N: the widest tree; every row's mask groups start there


def rows_layout(trees, owners: list[torch.Tensor | None], group: int, mask_id: int, width: int = 0) -> RowsLayout:
    """Every row's tree nodes padded to the widest tree (N), then its mask groups (G slots on each
    owner node, `tree_block`) padded to the most groups (M): q = N + M * G columns, or `width` when
    that is more (a device that runs the wider forward cheaper). A padding column holds `mask_id`
    at its own column's offset, sees only itself and is seen by no real query.

    Example: chains of 3 and 1 nodes, no groups: q = 3; row 1 is [root, pad, pad] with offsets
    [0, 1, 2] and block rows [0, -inf, -inf], [-inf, 0, -inf], [-inf, -inf, 0].
    """
    R = len(trees)
    ns = [len(t) for t in trees]
    ms = [0 if o is None else int(o.shape[0]) for o in owners]
    N, G = max(ns), group
    q = max(N + max(ms) * G, width)
    if q == 1 and N == 1:  # one node a row (AR): its token at its depth, no mask; what the loop below makes
        return RowsLayout(torch.cat([t.tokens for t in trees]).view(R, 1),
                          torch.cat([t.depths for t in trees]).view(R, 1), None, N)
    # every row's allowed columns as bit sets, unpacked at once: a few tensor ops a round whatever
    # its rows and trees (a row's block built of tensor ops had cost more per row than the rest)
    sets, offsets, tokens = [], [], []
    for t, o in zip(trees, owners):
        s, offs = row_sets(t.parents.tolist(), t.depths.tolist(), [] if o is None else o.tolist(), G, N, q)
        sets += s
        offsets += offs
        toks = t.tokens.tolist()
        tokens += toks + [mask_id] * (q - len(toks))
    blocks = additive(unpack_bits(sets, q).view(R, q, q))
    return RowsLayout(torch.tensor(tokens).view(R, q), torch.tensor(offsets).view(R, q), blocks, N)


# -- the forward's additive masks (`batch_forward.BatchForward`) ----------------------------------
class MaskBuffer:
    """A reused float [rows, cols] buffer: zero everywhere except the last step's block.

    Example: view(c=3, block) with a [2, 2] block returns a [2, 5] view whose first 3 columns
    are 0 and whose last 2 are `block`; the next call first zeroes those 2x2 cells again.
    """

    def __init__(self, device, dtype):
        self.device, self.dtype = device, dtype
        self.buf = torch.zeros(0, 0, device=device, dtype=dtype)
        self._dirty: tuple[int, int, int] | None = None  # (rows, col0, col1) written last

    def view(self, c: int, block: torch.Tensor) -> torch.Tensor:
        q = block.shape[0]
        if self.buf.shape[0] < q or self.buf.shape[1] < c + q:
            rows, cols = max(q, self.buf.shape[0]), max(c + q, 2 * self.buf.shape[1])
            self.buf = torch.zeros(rows, cols, device=self.device, dtype=self.dtype)
            self._dirty = None
        if self._dirty is not None:
            r, a, b = self._dirty
            self.buf[:r, a:b] = 0
        self.buf[:q, c : c + q] = block
        self._dirty = (q, c, c + q)
        return self.buf[:q, : c + q]


def mask_buffer(scratch: dict, device, dtype, segment: int = 0) -> MaskBuffer:
    """The request's reused one-row mask buffer (kept in the cache's `scratch`), one per segment of
    a forward (a joining chunk's mask must not overwrite the round's)."""
    key = ("mask", device, segment)
    buf = scratch.get(key)
    if buf is None:
        buf = scratch[key] = MaskBuffer(device, dtype)
    return buf


def own_block(R: int, q: int, causal: bool) -> torch.Tensor:
    """[R, q, q] additive block of new tokens with no tree among them: all see each other, or
    (causal) each sees itself and those before it. own_block(1, 2, True) -> [[[0, -inf], [0, 0]]]."""
    block = torch.zeros(q, q)
    if causal:
        block = block.masked_fill(torch.ones(q, q, dtype=torch.bool).triu(1), NEG)
    return block.expand(R, q, q)


def batch_mask(starts: list[int], block: torch.Tensor, dtype) -> torch.Tensor:
    """[R, 1, q, S] additive mask, S = max(starts) + q: row r sees slots < starts[r], its block at
    slots starts[r] .. starts[r]+q-1, nothing else (the lengths are host ints: no read of a tensor)."""
    R, q = block.shape[0], block.shape[1]
    S = max(starts) + q
    lengths = torch.tensor(starts, dtype=torch.long)
    cols = torch.arange(S)
    prefix = torch.where(cols[None, :] < lengths[:, None], 0.0, NEG)  # [R, S]
    mask = prefix[:, None, :].expand(R, q, S).clone()
    idx = (lengths[:, None, None] + torch.arange(q)[None, None, :]).expand(R, q, q)
    mask.scatter_(2, idx, block.float())
    return mask[:, None].to(dtype)
