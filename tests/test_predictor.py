import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from selfspec.config import DecodeConfig
from selfspec.predictor import FEATURES, LearnedRho, Predictor, auc, collect, round_examples, train
from selfspec.runtime import generate_ids
from selfspec.scoring import NgramRho
from selfspec.tree import Tree

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
    cfg = DecodeConfig(mode="presto", rho="learned", block_length=6, budget=8, max_new_tokens=24)
    with pytest.raises(ValueError, match="trained predictor"):
        generate_ids(model, prompt, cfg, eos_token_id=[])
    model.presto_predictor = Predictor().eval()
    ar = generate_ids(model, prompt, DecodeConfig(mode="ar", max_new_tokens=24), eos_token_id=[])[0]
    for schedule in ("one-pass", "two-pass"):
        cfg = DecodeConfig(mode="presto", schedule=schedule, rho="learned", block_length=6, budget=8, max_new_tokens=24)
        assert generate_ids(model, prompt, cfg, eos_token_id=[])[0] == ar
    rho = LearnedRho(model.presto_predictor, NgramRho(8, prompt))
    from selfspec.scoring import Expansion

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


@settings(max_examples=20, deadline=None)
@given(D=st.integers(1, 6), K=st.integers(1, 4), budget=st.integers(1, 30), seed=st.integers(0, 999))
def test_tabulated_learned_scores_build_the_same_tree_as_per_step_scoring(D, K, budget, seed):
    from selfspec.scoring import make_extra_score
    from selfspec.tree import build_tree

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
