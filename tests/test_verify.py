import torch

from selfspec.drafting.tree import Tree, chain, root_only
from selfspec.drafting.sampling import oracle_length, walk


def _tree(tokens, parents):
    p = torch.tensor(parents)
    d = [0] * len(parents)
    for i, q in enumerate(parents):
        d[i] = 0 if q < 0 else d[q] + 1
    return Tree(torch.tensor(tokens), p, torch.tensor(d))


def test_walk_worked_example():
    t = _tree([7, 11, 12, 13], [-1, 0, 0, 1])
    assert walk(t, torch.tensor([12, 5, 9, 4])) == ([0, 2], 9)


def test_walk_follows_the_deepest_matching_branch():
    t = _tree([7, 11, 12, 13, 14], [-1, 0, 0, 1, 3])
    assert walk(t, torch.tensor([11, 13, 0, 14, 99])) == ([0, 1, 3, 4], 99)


def test_walk_on_a_chain_is_linear_acceptance():
    t = chain([1, 2, 3, 4])
    assert walk(t, torch.tensor([2, 3, 9, 9])) == ([0, 1, 2], 9)
    assert walk(t, torch.tensor([5, 3, 4, 8])) == ([0], 5)


def test_walk_of_a_lone_root_emits_its_target_as_a_python_int():
    path, bonus = walk(root_only(7), torch.tensor([42]))
    assert path == [0] and bonus == 42 and type(bonus) is int


def test_oracle_length_worked_example():
    assert oracle_length(torch.tensor([[3, 4], [5, 6]]), [4, 9, 1]) == 2
    assert oracle_length(torch.tensor([[3, 4], [5, 6]]), [4, 6, 1]) == 3


def test_truncate_keeps_the_eos_and_stops_at_the_room():
    from selfspec.drafting.sampling import truncate

    assert truncate([5, 2, 7], {2}, 8) == ([5, 2], True)
    assert truncate([5, 6, 7], {2}, 2) == ([5, 6], False)
