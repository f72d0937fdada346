import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from selfspec.engine.request.options import DecodeConfig
from selfspec.training.predictor import FEATURES, LearnedRho, Predictor, auc, collect, round_examples, train
from selfspec.engine.schedule.decoder import generate_ids
from selfspec.drafting.scoring import NgramRho
from selfspec.drafting.tree import Tree

from conftest import tiny_model


def test_features_of_a_hand_built_tree():
    # root 7 -> child 9 (depth 1, rank 1); depth-1 candidates (5, 9), depth-2 candidates (9, 3)
    tree = Tree(torch.tensor([7, 9]), torch.tensor([-1, 0]), torch.tensor([0, 1]))
    cand_lq = torch.tensor([[-0.1, -2.5], [-0.5, -1.0]])
    cand_tok = torch.tensor([[5, 9], [9, 3]])
    targets = torch.tensor([9, 3])  # target after root is 9 (child accepted), after 7,9 is 3
    x, y = round_examples(tree, cand_lq, cand_tok, targets, torch.tensor([1.2, 0.7]), (4, 7), None)
    assert x.shape == (4, len(FEATURES))
    f = {name: x[:, i].tolist() for i, name in enumerate(FEATURES)}
    assert f["lq"] == pytest.approx([-0.1, -2.5, -0.5, -1.0])
    assert f["rank"] == [0, 1, 0, 1]
    assert f["depth"] == [1, 1, 2, 2]
    assert f["entropy"] == pytest.approx([1.2, 1.2, 0.7, 0.7])
    assert f["parent_rank"] == [-1, -1, 1, 1] and f["parent_lq"] == pytest.approx([0, 0, -2.5, -2.5])
    assert f["margin"] == pytest.approx([0, -2.4, 0, -0.5])
    assert f["repeat"] == [0, 0, 1, 0]  # candidate 9 under node 9
    assert y.tolist() == [0, 1, 0, 1]


def test_training_on_separable_synthetic_data_reaches_high_auc():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, len(FEATURES), generator=g)
    y = ((x[:, 0] - 0.7 * x[:, 6] + 0.2 * x[:, 3]) > 0).float()
    pred, metrics = train(x, y, epochs=200)
    assert metrics["val_auc"] > 0.97
    assert metrics["val_ece"] < 0.08
    assert auc(torch.tensor([0.1, 0.9, 0.2, 0.8]), torch.tensor([0.0, 1.0, 0.0, 1.0])) == 1.0


def test_a_predictor_on_a_feature_subset_ignores_the_other_columns(tmp_path):
    pred = Predictor(["ngram", "depth"])
    f = torch.randn(5, len(FEATURES))
    g = f.clone()
    g[:, FEATURES.index("lq")] += 100.0
    assert torch.equal(pred(f), pred(g))
    pred.save(str(tmp_path), {})
    assert Predictor.load(str(tmp_path)).inputs == ["ngram", "depth"]
    with pytest.raises(ValueError, match="subset"):
        Predictor(["nope"])


def test_predictor_round_trip_and_mismatched_files(tmp_path):
    pred = Predictor()
    pred.save(str(tmp_path), {"metrics": {}})
    again = Predictor.load(str(tmp_path))
    f = torch.randn(3, len(FEATURES))
    assert torch.allclose(again(f), pred(f))
    assert Predictor.load(str(tmp_path / "nowhere")) is None
    meta = json.loads((tmp_path / "presto_predictor.json").read_text())
    meta["features"] = meta["features"][:-1]
    (tmp_path / "presto_predictor.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="do not match"):
        Predictor.load(str(tmp_path))


def test_learned_rho_needs_a_predictor_and_keeps_greedy_exact(tmp_path):
    model = tiny_model(vocab_size=8)
    prompt = [5, 6, 7, 5, 6]
    cfg = DecodeConfig(mode="presto", schedule="one-pass", rho="learned", block_length=6, budget=8, max_new_tokens=24)
    with pytest.raises(ValueError, match="trained predictor"):
        generate_ids(model, prompt, cfg, eos_token_id=[])
    model.presto_predictor = Predictor().eval()
    ar = generate_ids(model, prompt, DecodeConfig(mode="ar", max_new_tokens=24), eos_token_id=[])[0]
    for schedule in ("one-pass", "two-pass"):
        cfg = DecodeConfig(mode="presto", schedule=schedule, rho="learned", block_length=6, budget=8, max_new_tokens=24)
        assert generate_ids(model, prompt, cfg, eos_token_id=[])[0] == ar
    rho = LearnedRho(model.presto_predictor, NgramRho(8, prompt))
    from selfspec.drafting.scoring import Expansion

    z = torch.zeros(2, 3)
    x = Expansion(1, z.long(), z.long(), z.long(), z - 1, z, z, z - 1, 0.5)
    assert (rho.log_rho(x) <= 0).all()


def test_collection_writes_resumable_shards(tmp_path):
    class Tok:
        def encode(self, text):
            return [5 + (ord(c) % 3) for c in text]

    model = tiny_model(vocab_size=8)
    n = collect(model, Tok(), ["abcab", "bcabc", "cabca"], str(tmp_path), max_new_tokens=12, block_length=4,
                budget=6, tree_top_k=2, shard_size=2)
    assert n > 0 and sorted(p.name for p in tmp_path.iterdir()) == ["shard_0000.pt", "shard_0001.pt"]
    assert collect(model, Tok(), ["abcab", "bcabc", "cabca"], str(tmp_path), shard_size=2) == 0  # resumed: nothing to redo
    data = torch.load(tmp_path / "shard_0000.pt")
    assert data["x"].shape[1] == len(FEATURES) and data["x"].shape[0] == data["y"].shape[0]
    assert set(data["y"].tolist()) == {0.0, 1.0} and data["temperature"] == 0.0  # greedy: match labels


@settings(max_examples=20, deadline=None)
@given(D=st.integers(1, 6), K=st.integers(1, 4), budget=st.integers(1, 30), seed=st.integers(0, 999))
def test_tabulated_learned_scores_build_the_same_tree_as_per_step_scoring(D, K, budget, seed):
    from selfspec.drafting.scoring import make_extra_score
    from selfspec.drafting.tree import build_tree

    g = torch.Generator().manual_seed(seed)
    logq = (torch.randn(D, 40, generator=g) * 2).log_softmax(-1)
    vals, toks = logq.topk(K, dim=-1)
    entropy = torch.rand(D, generator=g) * 3
    torch.manual_seed(seed)
    pred = Predictor().eval()
    with torch.no_grad():
        pred.fc1.weight.mul_(3.0)
    rho = LearnedRho(pred, NgramRho(40, torch.randint(0, 40, (50,), generator=g)))
    tabulated = make_extra_score(rho, 1.0)
    per_step = lambda x: tabulated(x)  # noqa: E731  (no .table)
    a = build_tree(9, vals, toks, budget=budget, extra_score=tabulated, history=(3, 9), entropy=entropy)
    b = build_tree(9, vals, toks, budget=budget, extra_score=per_step, history=(3, 9), entropy=entropy)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert torch.allclose(a.scores, b.scores, atol=1e-5)


# -- labels at T > 0: the verifier's acceptance probability -----------------------------------------
def test_acceptance_probs_worked_example():
    from selfspec.training.predictor import acceptance_probs

    logits = torch.tensor([[0.0, float(torch.tensor(3.0).log()), -1e9]])
    assert acceptance_probs(logits, temperature=1.0).tolist()[0][:2] == pytest.approx([0.25, 0.75])
    assert acceptance_probs(logits, temperature=0.0) is None  # greedy: labels are argmax matches
    assert acceptance_probs(logits, temperature=1.0, banned=1)[0, 1] == 0.0  # the mask id is never drawn


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.6, 3, 1.0), (1.3, 0, 0.8)])
def test_soft_labels_equal_the_rate_at_which_the_verifier_accepts_each_candidate(temperature, top_k, top_p):
    from selfspec.training.predictor import acceptance_probs
    from selfspec.drafting.sampling import select
    from selfspec.drafting.sampling import walk

    g = torch.Generator().manual_seed(1)
    V = 6
    node_logits = torch.randn(1, V, generator=g) * 1.5
    # root 0 with one child per vocabulary token: the walk accepts child t iff the draw is t
    tree = Tree(torch.tensor([9] + list(range(V))), torch.tensor([-1] + [0] * V), torch.tensor([0] + [1] * V))
    p = acceptance_probs(node_logits, temperature=temperature, top_k=top_k, top_p=top_p, banned=4)[0]
    n = 8000
    draws = select(node_logits.expand(n, V), temperature=temperature, top_k=top_k, top_p=top_p, banned=4, generator=g)
    accepted = torch.zeros(V)
    for t in draws.tolist():
        path, _ = walk(tree, torch.tensor([t] + [0] * V))
        accepted[tree.tokens[path[1]]] += 1
    assert torch.allclose(accepted / n, p, atol=0.02)


def test_round_examples_take_soft_labels_from_the_node_distribution():
    tree = Tree(torch.tensor([7, 9]), torch.tensor([-1, 0]), torch.tensor([0, 1]))
    cand_lq = torch.tensor([[-0.1, -2.5], [-0.5, -1.0]])
    cand_tok = torch.tensor([[5, 9], [9, 3]])
    probs = torch.zeros(2, 10)
    probs[0, 5], probs[0, 9], probs[1, 9], probs[1, 3] = 0.2, 0.7, 0.05, 0.6
    x, y = round_examples(tree, cand_lq, cand_tok, torch.tensor([9, 3]), None, (4, 7), None, target_probs=probs)
    assert y.tolist() == pytest.approx([0.2, 0.7, 0.05, 0.6])  # (root: 5, 9), (node 9: 9, 3)
    x0, _ = round_examples(tree, cand_lq, cand_tok, torch.tensor([9, 3]), None, (4, 7), None)
    assert torch.equal(x, x0)  # the features do not depend on the labels


def test_collection_at_temperature_one_records_reproducible_soft_labels(tmp_path):
    class Tok:
        def encode(self, text):
            return [5 + (ord(c) % 3) for c in text]

    model = tiny_model(vocab_size=8)
    kw = dict(max_new_tokens=8, block_length=4, budget=6, tree_top_k=2, temperature=1.0, seed=3)
    collect(model, Tok(), ["abcab", "bcabc"], str(tmp_path / "a"), **kw)
    collect(model, Tok(), ["abcab", "bcabc"], str(tmp_path / "b"), **kw)
    collect(model, Tok(), ["abcab", "bcabc"], str(tmp_path / "c"), **{**kw, "seed": 4})
    a, b, c = (torch.load(tmp_path / d / "shard_0000.pt") for d in "abc")
    assert torch.equal(a["y"], b["y"]) and a["temperature"] == 1.0
    assert a["x"].shape != c["x"].shape or not torch.equal(a["x"], c["x"])  # sampled trajectories
    assert ((a["y"] > 0) & (a["y"] < 1)).float().mean() > 0.5  # probabilities, not matches


def test_soft_auc_reduces_to_the_rank_statistic_and_counts_pairs_by_weight():
    assert auc(torch.tensor([0.3, 0.6]), torch.tensor([0.5, 0.5])) == pytest.approx(0.5)
    g = torch.Generator().manual_seed(0)
    s, y = torch.randn(40, generator=g), torch.rand(40, generator=g)
    pairs = [(y[i] * (1 - y[j]), float(s[i] > s[j])) for i in range(40) for j in range(40) if i != j]
    expected = sum(w * win for w, win in pairs) / sum(w for w, _ in pairs)
    assert auc(s, y) == pytest.approx(float(expected), abs=1e-6)
    hard = (y > 0.5).float()
    pos, neg = s[hard == 1], s[hard == 0]
    assert auc(s, hard) == pytest.approx(float((pos[:, None] > neg[None, :]).float().mean()))


def test_training_on_soft_labels_recovers_the_probabilities():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, len(FEATURES), generator=g)
    p = torch.sigmoid(1.5 * x[:, 0] - x[:, 6])
    pred, metrics = train(x, p, epochs=150)
    with torch.no_grad():
        err = (torch.sigmoid(pred(x)) - p).abs().mean()
    assert err < 0.03  # hard 0/1 targets at p > 0.5 would push predictions to the extremes
    assert metrics["val_ece"] < 0.03
