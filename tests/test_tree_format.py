import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.serving.tree_format import EagleTree, from_eagle, greedy_accept, to_eagle
from selfspec.drafting.tree import Tree, ancestors, chain
from selfspec.drafting.sampling import walk

VOCAB = 4  # few tokens: sibling clashes and repeated tokens happen often


@st.composite
def trees(draw, max_nodes=40):
    n = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    return Tree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def _example():
    return Tree(torch.tensor([7, 11, 12, 13]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]))


def test_the_worked_example_has_the_documented_tensors():
    t = to_eagle(_example(), seq_len=5)
    assert t.candidates.tolist() == [7, 11, 12, 13]
    assert t.retrieve_index.tolist() == [0, 1, 2, 3]
    assert t.retrieve_next_token.tolist() == [1, 3, -1, -1]
    assert t.retrieve_next_sibling.tolist() == [-1, 2, -1, -1]
    assert t.tree_mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert t.positions.tolist() == [5, 6, 6, 7]
    assert greedy_accept(t, torch.tensor([12, 5, 9, 4])) == ([0, 2], 9)


@settings(max_examples=300, deadline=None)
@given(tree=trees(), seq_len=st.integers(0, 50))
def test_round_trip_returns_the_same_tree(tree, seq_len):
    back = from_eagle(to_eagle(tree, seq_len=seq_len), seq_len=seq_len)
    assert back.tokens.tolist() == tree.tokens.tolist()
    assert back.parents.tolist() == tree.parents.tolist()
    assert back.depths.tolist() == tree.depths.tolist()


@settings(max_examples=300, deadline=None)
@given(tree=trees(), data=st.data())
def test_greedy_verification_over_the_tensors_accepts_what_walk_accepts(tree, data):
    targets = torch.tensor(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=len(tree), max_size=len(tree))))
    offset = data.draw(st.integers(0, 3)) * len(tree)  # this request's slice of a flattened batch
    batch = torch.full((offset + len(tree) + 5,), -7)
    batch[offset:offset + len(tree)] = targets
    assert greedy_accept(to_eagle(tree, offset=offset), batch) == walk(tree, targets)


@settings(max_examples=200, deadline=None)
@given(tree=trees(), seq_len=st.integers(0, 50))
def test_mask_is_ancestor_or_self_and_positions_are_seq_len_plus_depth(tree, seq_len):
    t = to_eagle(tree, seq_len=seq_len)
    par = tree.parents.tolist()
    for i in range(len(tree)):
        anc = set()
        v = i
        while v >= 0:
            anc.add(v)
            v = par[v]
        assert {j for j in range(len(tree)) if t.tree_mask[i, j]} == anc
    assert t.positions.tolist() == [seq_len + d for d in tree.depths.tolist()]


def test_speculative_token_bound_caps_the_accepted_path():
    t = to_eagle(chain([1, 2, 3, 4]))
    assert greedy_accept(t, torch.tensor([2, 3, 4, 9])) == ([0, 1, 2, 3], 9)
    assert greedy_accept(t, torch.tensor([2, 3, 4, 9]), num_speculative_tokens=3) == ([0, 1, 2], 4)


def _broken(**changes):
    t = to_eagle(_example(), seq_len=5)
    fields = {k: getattr(t, k).clone() for k in t.__dataclass_fields__}
    for k, (i, v) in changes.items():
        fields[k][i] = v
    return EagleTree(**fields)


@pytest.mark.parametrize("changes, match", [
    ({"retrieve_next_sibling": (1, -1)}, "reached by no"),             # node 2 unlinked
    ({"retrieve_next_token": (2, 1)}, "linked twice"),                 # node 1 under two parents
    ({"retrieve_next_token": (3, 1)}, "linked twice"),                 # a cycle 1 -> 3 -> 1
    ({"retrieve_next_token": (1, 9)}, "out of range"),
    ({"positions": (3, 6)}, "positions"),
    ({"tree_mask": ((3, 2), True)}, "ancestor-or-self"),
])
def test_inconsistent_tensors_are_refused_with_a_named_error(changes, match):
    with pytest.raises(ValueError, match=match):
        from_eagle(_broken(**changes), seq_len=5)


def test_tensors_of_mismatched_length_are_refused():
    t = to_eagle(_example())
    with pytest.raises(ValueError, match="retrieve_next_token has shape"):
        EagleTree(t.candidates, t.retrieve_index, t.retrieve_next_token[:2], t.retrieve_next_sibling,
                  t.tree_mask, t.positions)


def test_a_tree_from_the_builder_keeps_its_ancestor_matrix():
    tree = _example()
    assert torch.equal(to_eagle(tree).tree_mask, ancestors(tree.parents))
