import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import reference_cache as kv
from selfspec.engine.forward.masks import additive, joint_training_allowed, row_sets, rows_layout, tree_and_groups, tree_block
from selfspec.drafting.tree import Tree, path_to

from conftest import tiny_model

MODEL = tiny_model(seed=1)
MASK = MODEL.config.mask_token_id


@st.composite
def trees(draw):
    n = draw(st.integers(1, 9))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    tokens = draw(st.lists(st.integers(5, 63), min_size=n, max_size=n))
    owners = sorted(draw(st.sets(st.integers(0, n - 1), max_size=n)))
    G = draw(st.integers(1, 4))
    prefix = draw(st.lists(st.integers(5, 63), min_size=1, max_size=6))
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths)), torch.tensor(owners, dtype=torch.long), G, prefix


def test_worked_example_in_docstring():
    lay = tree_and_groups(2, torch.tensor([-1, 0]), torch.tensor([0, 1]), torch.tensor([1]), 2)
    allowed = lay.mask[0, 0] == 0
    assert allowed.int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]
    assert lay.positions.tolist() == [[2, 3, 4, 5]]
    assert lay.mask.dtype == torch.float32 and torch.isinf(lay.mask).any()


@settings(max_examples=30, deadline=None)
@given(trees())
def test_combined_mask_matches_causal_paths_and_standalone_groups(case):
    tree, owners, G, prefix = case
    c = len(prefix)
    cache = kv.new_cache(MODEL)
    with torch.inference_mode():
        MODEL(torch.tensor([prefix]), cache=cache)
        lay = tree_and_groups(c, tree.parents, tree.depths, owners, G)
        q = torch.cat([tree.tokens, torch.full((len(owners) * G,), MASK)])
        logits = MODEL(q[None], position_ids=lay.positions, attention_mask=lay.mask, cache=cache).logits[0]
        n = len(tree)
        for v in range(n):
            path = tree.tokens[path_to(tree.parents, v)].tolist()
            ref = MODEL(torch.tensor([prefix + path])).logits[0, -1]
            assert torch.allclose(logits[v], ref, atol=1e-4), v
        for j, u in enumerate(owners.tolist()):
            path = tree.tokens[path_to(tree.parents, u)].tolist()
            L = c + len(path)
            allowed = torch.ones(L + G, L + G, dtype=torch.bool)
            allowed[:L, :L] = torch.ones(L, L, dtype=torch.bool).tril()
            allowed[:L, L:] = False
            seq = torch.tensor([prefix + path + [MASK] * G])
            ref = MODEL(seq, attention_mask=additive(allowed)[None, None]).logits[0, L:]
            assert torch.allclose(logits[lay.group_rows(j)], ref, atol=1e-4), j


def test_row_sets_worked_example_in_docstring():
    sets, offsets = row_sets([-1, 0], [0, 1], [1], 2, 3, 5)
    assert sets == [0b1, 0b11, 0b100, 0b11011, 0b11011] and offsets == [0, 1, 2, 2, 3]


def test_joint_training_mask_worked_example():
    a = joint_training_allowed(4, 2, offset=1)  # blocks [0, 1, 1, 2]
    noisy1 = a[1].int().tolist()
    assert noisy1 == [0, 1, 1, 0, 1, 0, 0, 0]
    clean2 = a[4 + 2].int().tolist()
    assert clean2 == [0, 0, 0, 0, 1, 1, 1, 0]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 100), min_size=0, max_size=7), st.integers(0, 3)),
                min_size=1, max_size=4), st.integers(1, 3))
def test_rows_layout_keeps_each_rows_block_and_padding_sees_only_itself(rows, G):
    """Brute force per row: its real queries see each other exactly as its own `tree_block` says
    and see no padding; every padding column sees only itself; offsets follow the row's own."""
    trees, owners = [], []
    for seeds, m in rows:
        parents = [-1] + [s % (i + 1) for i, s in enumerate(seeds)]  # node i+1's parent is one of 0..i
        depths = [0]
        for p in parents[1:]:
            depths.append(depths[p] + 1)
        n = len(parents)
        trees.append(Tree(torch.arange(10, 10 + n), torch.tensor(parents), torch.tensor(depths)))
        owners.append(None if m == 0 else torch.arange(min(m, n)))
    lay = rows_layout(trees, owners, G, mask_id=4)
    N = max(len(t) for t in trees)
    q = N + max(0 if o is None else len(o) for o in owners) * G
    assert lay.tokens.shape == (len(trees), q) and lay.nodes == N
    # no token sits later than its column: the forward bounds positions by max(lengths) + q, no read
    assert (lay.offsets <= torch.arange(q)).all()
    for i, (t, o) in enumerate(zip(trees, owners)):
        n, m = len(t), 0 if o is None else len(o)
        cols = list(range(n)) + [N + j for j in range(m * G)]
        block, offs = tree_block(t.parents, t.depths, o, G if o is not None else 0)
        assert lay.tokens[i, :n].tolist() == t.tokens.tolist()
        assert lay.offsets[i, cols].tolist() == offs.tolist()
        if lay.blocks is None:
            assert q == 1
            continue
        seen = lay.blocks[i] == 0
        assert torch.equal(seen[cols][:, cols], block == 0)
        pad = [c for c in range(q) if c not in cols]
        for c in pad:
            assert seen[c].nonzero().flatten().tolist() == [c] and lay.tokens[i, c] == 4
        assert not seen[cols][:, pad].any()
