"""Context candidates: prompt-lookup chains (mode "lookup") and PRESTO trees whose candidates are
q's top-K plus each path's context continuations (issue 12's p* candidate space)."""

import itertools
import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.schedule.decoder import generate_ids
from selfspec.drafting.scoring import NgramRho, TokenScore
from selfspec.drafting.tree import ContextCandidates, build_tree, is_prefix_closed, path_to

from conftest import SHIPPED, tiny_model


def _fake_propose(V, E):
    """A deterministic stand-in for the context index: continuations depend on the whole path."""
    def propose(ctx):
        h = hash(tuple(ctx)) % (V * V)
        return [h % V, (h // V) % V][:E]
    return propose


def _brute_force(root, logq, K, propose, ctx, score, depth, n):
    """Every path of the candidate space with its p* score; the best n nodes (ties: shallower)."""
    nodes = {}  # path (tuple of tokens) -> score

    def grow(path, s, w2, w1, c):
        d = len(path) + 1
        if d > depth:
            return
        top = logq[d - 1].topk(K).indices.tolist()
        extra = [t for t in propose(list(c)) if t not in top]
        for t in list(dict.fromkeys(top + extra[:2])):
            v = s + float(logq[d - 1, t]) + (float(score.tokens(torch.tensor([w2]), torch.tensor([w1]),
                                                                  torch.tensor([t]), d)[0]) if score else 0.0)
            nodes[path + (t,)] = v
            grow(path + (t,), v, w1, t, (c + (t,))[-len(ctx):])

    grow((), 0.0, ctx[-2], root, tuple(ctx))
    ranked = sorted(nodes, key=lambda p: (-nodes[p], len(p)))
    return set(ranked[:n])


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), budget=st.integers(1, 12), lam=st.sampled_from([0.0, 0.5]))
def test_hybrid_tree_is_the_top_n_of_p_star_over_the_candidate_space(seed, budget, lam):
    g = torch.Generator().manual_seed(seed)
    V, D, K = 9, 3, 2
    logq = torch.randn(D, V, generator=g).log_softmax(-1)
    lq, tok = logq.topk(K)
    ctx = (1, 2, 3)
    rho = NgramRho(V, torch.randint(0, V, (30,), generator=g))
    score = TokenScore(rho, lam) if lam else None
    look = ContextCandidates(_fake_propose(V, 2), logq, ctx, width=2, paths=10**6)
    tree = build_tree(3, lq, tok, budget=budget, extra_score=score, history=(2, 3), lookup=look)
    assert is_prefix_closed(tree) and len(tree) - 1 <= budget
    got = {tuple(tree.tokens[path_to(tree.parents, v)[1:]].tolist()) for v in range(1, len(tree))}
    assert got == _brute_force(3, logq, K, look.propose, ctx, score, D, budget)


def test_context_continuations_enter_the_tree_when_the_context_predicts_them():
    V, D, K = 12, 1, 2
    logq = torch.full((D, V), -5.0)
    logq[:, 0], logq[:, 1] = -0.1, -0.2  # q's top-2 are tokens 0 and 1
    logq[0, 7] = -0.5  # the context's continuation is q's rank 3: outside the top-K
    lq, tok = logq.topk(K)
    look = ContextCandidates(lambda ctx: [7] if ctx[-1] == 3 else [], logq, (2, 3), width=1, paths=4)
    with_ctx = build_tree(3, lq, tok, budget=3, lookup=look)
    without = build_tree(3, lq, tok, budget=3)
    assert 7 in with_ctx.tokens.tolist() and 7 not in without.tokens.tolist()
    i = with_ctx.tokens.tolist().index(7)
    assert with_ctx.parents[i] == 0 and with_ctx.scores[i].item() == pytest.approx(-0.5)


MODELS = [(8, 0), (12, 1)]


@pytest.mark.parametrize("key", MODELS)
def test_lookup_mode_greedy_matches_ar_and_accepts_copied_tokens(key):
    m = tiny_model(seed=key[1], vocab_size=key[0])
    p = torch.randint(5, key[0], (10,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0]
    out, st = generate_ids(m, p, DecodeConfig(mode="lookup", max_new_tokens=40, lookup_tokens=6), eos_token_id=[])
    assert out == ar
    assert sum(a > 1 for a in st.accept_lengths) >= 2  # copies were really accepted
    assert st.forwards == st.rounds and st.oracle_lengths == []


@pytest.mark.parametrize("key", MODELS)
@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
def test_hybrid_presto_greedy_matches_ar(key, schedule):
    m = tiny_model(seed=key[1], vocab_size=key[0])
    p = torch.randint(5, key[0], (10,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0]
    cfg = DecodeConfig(mode="presto", schedule=schedule, block_length=8, budget=8, lookup=True, max_new_tokens=40)
    out, st = generate_ids(m, p, cfg, eos_token_id=[])
    assert out == ar
    assert sum(a > 1 for a in st.accept_lengths) >= 2


@pytest.mark.parametrize("kwargs, match", [
    (dict(lookup_min_ngram=0), "lookup_min_ngram"),
    (dict(lookup_min_ngram=4, lookup_max_ngram=3), "lookup_min_ngram"),
    (dict(lookup_tokens=0), "lookup_tokens"),
    (dict(mode="presto", lookup=True, rho="learned"), "token-level rho"),
])
def test_bad_lookup_options_are_refused_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecodeConfig(**kwargs)


def test_a_prompt_shorter_than_the_ngram_is_no_match_and_no_error():
    m = tiny_model(seed=1, vocab_size=12)
    out, st = generate_ids(m, [7], DecodeConfig(mode="lookup", max_new_tokens=5, lookup_min_ngram=3,
                                                 lookup_max_ngram=4), eos_token_id=[])
    assert out == generate_ids(m, [7], DecodeConfig(mode="ar", max_new_tokens=5), eos_token_id=[])[0]


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "model.safetensors")), reason="no shipped model")
def test_on_the_shipped_model_context_candidates_raise_tau_and_keep_greedy_exact(default_model):
    model, tok = default_model
    with open(os.path.join(SHIPPED, "prompts.jsonl")) as f:
        prompts = [json.loads(line)["prompt"] for line in itertools.islice(f, 4)]
    taus = {}
    for name, extra in (("presto", dict(lookup=False)), ("hybrid", dict(lookup=True)), ("lookup", None)):
        rounds = tokens = 0
        for p in prompts:
            ids = tok.encode(p)
            cfg = (DecodeConfig(mode="lookup", max_new_tokens=32) if extra is None else
                   DecodeConfig(mode="presto", schedule="two-pass", budget=8, block_length=8, max_new_tokens=32, **extra))
            out, st = generate_ids(model, ids, cfg)
            assert out == generate_ids(model, ids, DecodeConfig(mode="ar", max_new_tokens=32))[0]
            rounds, tokens = rounds + st.rounds, tokens + st.round_tokens
        taus[name] = tokens / rounds
    assert taus["hybrid"] > taus["presto"] + 0.05, taus
