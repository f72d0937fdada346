import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.drafting.scoring import NgramRho, make_extra_score
from selfspec.drafting.tree import ancestors, build_tree, chain, is_prefix_closed, path_to, unpack_bits


def _random_logq(D, V, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(D, V, generator=g) * 2).log_softmax(-1)


def test_chain_is_a_degenerate_tree():
    t = chain([5, 6, 7])
    assert t.parents.tolist() == [-1, 0, 1] and t.depths.tolist() == [0, 1, 2]


def test_ancestors_matches_walking_parents():
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 3])
    anc = ancestors(parents)
    for v in range(7):
        expect = set(path_to(parents, v))
        assert {u for u in range(7) if anc[v, u]} == expect


@pytest.mark.parametrize("n", [1, 2, 61, 62, 63, 64, 124, 125, 200])
def test_ancestors_of_trees_wider_than_one_word_match_walking_parents(n):
    g = torch.Generator().manual_seed(n)
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])
    anc = ancestors(parents)
    assert anc.shape == (n, n) and anc.dtype == torch.bool
    for v in range(n):
        assert anc[v].nonzero().flatten().tolist() == sorted(path_to(parents, v))


def test_unpack_bits_reads_bit_j_into_column_j():
    assert unpack_bits([5], 3).tolist() == [[True, False, True]]
    assert unpack_bits([1 << 70 | 1], 71)[0].nonzero().flatten().tolist() == [0, 70]
    assert unpack_bits([], 4).shape == (0, 4)


def test_worked_example_in_docstring():
    q = torch.tensor([[0.6, 0.3, 0.1], [0.9, 0.05, 0.05]]).log()
    vals, toks = q.topk(2, dim=-1)
    t = build_tree(9, vals, toks, budget=2)
    assert t.tokens.tolist() == [9, 0, 0] and t.parents.tolist() == [-1, 0, 1]


@settings(max_examples=40, deadline=None)
@given(D=st.integers(1, 4), V=st.integers(2, 5), K=st.integers(1, 3), budget=st.integers(1, 12), seed=st.integers(0, 10_000))
def test_lambda_zero_tree_is_the_top_paths_by_marginal_product(D, V, K, budget, seed):
    logq = _random_logq(D, V, seed)
    vals, toks = logq.topk(min(K, V), dim=-1)
    tree = build_tree(0, vals, toks, budget=budget)
    assert is_prefix_closed(tree) and len(tree) - 1 <= budget
    # brute force: every path in the top-K candidate space, scored by the product of marginals
    scores = {}
    for d in range(1, D + 1):
        for path in itertools.product(*[toks[i].tolist() for i in range(d)]):
            scores[path] = sum(float(logq[i, t]) for i, t in enumerate(path))
    best = sorted(scores.values(), reverse=True)[: min(budget, len(scores))]
    got = sorted((sum(float(logq[tree.depths[u] - 1, tree.tokens[u]]) for u in path_to(tree.parents, v)[1:])
                  for v in range(1, len(tree))), reverse=True)
    assert len(got) == len(best)
    assert all(math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) for a, b in zip(got, best))


@settings(max_examples=25, deadline=None)
@given(D=st.integers(1, 6), budget=st.integers(1, 40), lam=st.sampled_from([0.1, 0.2, 1.0]), seed=st.integers(0, 999))
def test_ngram_scored_tree_is_prefix_closed_and_within_budget(D, budget, lam, seed):
    V = 20
    logq = _random_logq(D, V, seed)
    vals, toks = logq.topk(4, dim=-1)
    rho = NgramRho(V, torch.randint(0, V, (50,), generator=torch.Generator().manual_seed(seed)))
    tree = build_tree(3, vals, toks, budget=budget, extra_score=make_extra_score(rho, lam), history=(1, 3))
    assert is_prefix_closed(tree)
    assert 1 <= len(tree) <= budget + 1
    assert int(tree.depths.max()) <= D
    # depths are consistent with parents and children never precede parents
    for v in range(1, len(tree)):
        assert tree.depths[v] == tree.depths[tree.parents[v]] + 1
    # siblings carry distinct tokens (a walk needs an unambiguous child)
    pairs = list(zip(tree.parents.tolist(), tree.tokens.tolist()))
    assert len(set(pairs)) == len(pairs)


def test_max_depth_caps_the_tree():
    vals, toks = _random_logq(8, 10, 0).topk(3, dim=-1)
    assert build_tree(0, vals, toks, budget=50, max_depth=2).max_depth <= 2
    assert len(build_tree(0, vals, toks, budget=50, max_depth=0)) == 1


def test_budget_below_one_is_rejected_by_the_decode_config():
    from selfspec.engine.request.options import DecodeConfig

    for bad in (dict(budget=0), dict(tree_top_k=0), dict(lam=-0.1), dict(group_size=0)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)


def test_group_owners_worked_example_and_fallback():
    from selfspec.drafting.tree import group_owners, nearest_owner

    t = chain([1, 2, 3], torch.tensor([0.0, -0.1, -2.0]))
    assert group_owners(t, 2).tolist() == [0, 1]
    assert group_owners(t, None).tolist() == [0, 1, 2]
    assert nearest_owner(t.parents, torch.tensor([0, 1]), 2) == (1, 1)
    assert nearest_owner(t.parents, torch.tensor([0]), 2) == (0, 0)


@settings(max_examples=25, deadline=None)
@given(D=st.integers(1, 7), K=st.integers(1, 5), budget=st.integers(1, 40), short=st.booleans(), seed=st.integers(0, 999))
def test_tabulated_token_scores_build_the_same_tree_as_per_step_scoring(D, K, budget, short, seed):
    V = 30
    logq = _random_logq(D, V, seed)
    vals, toks = logq.topk(K, dim=-1)
    rho = NgramRho(V, torch.randint(0, V, (60,), generator=torch.Generator().manual_seed(seed)))
    tabulated = make_extra_score(rho, 0.5)
    per_step = lambda x: tabulated(x)  # noqa: E731  (no .table: the builder scores each step)
    history = (-1 if short else 2, 7)
    a = build_tree(7, vals, toks, budget=budget, extra_score=tabulated, history=history)
    b = build_tree(7, vals, toks, budget=budget, extra_score=per_step, history=history)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.allclose(a.scores, b.scores, atol=1e-5)
