"""The automatic plan: calibration, expected tokens, choices under GPU-like and CPU-like costs."""

import json
import os

import pytest
import torch

from selfspec.engine.options import DecodeConfig
from selfspec.engine.calibration import Calibrator, acceptance
from selfspec.engine.layouts import Option, config_label
from selfspec.engine.planner import Forecast, Planner, log2_budgets
from selfspec.engine.profile import CostProfile
from selfspec.engine.decoder import Decoder, generate_ids

from conftest import SHIPPED, tiny_model


def test_acceptance_multiplies_down_paths_and_caps_siblings():
    chain = acceptance(torch.tensor([0.5, 0.5]), torch.tensor([-1, 0, 1]))
    assert chain.tolist() == [1.0, 0.5, 0.25]
    # two siblings claiming 0.8 each cannot both be the target's token: scaled to sum 1
    sib = acceptance(torch.tensor([0.8, 0.8]), torch.tensor([-1, 0, 0]))
    assert sib.tolist() == pytest.approx([1.0, 0.5, 0.5])
    # endpoint masses of the chain: 0.5, 0.25, 0.25 -> one group covers half, two cover 3/4
    cover = Forecast(chain, torch.tensor([-1, 0, 1]), torch.tensor([0, 1, 2])).coverage(2)
    assert cover == pytest.approx([0.5, 0.75, 1.0])


def test_calibrator_moves_from_the_score_prior_to_observed_acceptance():
    cal = Calibrator()
    x = torch.tensor([-0.25])
    assert cal.prob(x).item() == pytest.approx(torch.tensor(-0.125).exp().item(), rel=1e-6)
    for _ in range(50):
        cal.update(x, torch.tensor([True]), torch.tensor([False]))
    assert cal.prob(x).item() < 0.05
    assert cal.prob(torch.tensor([-3.2])).item() == pytest.approx(torch.tensor(-3.25 / 2).exp().item(), rel=1e-6)


def _forecast(p_children: float, depth: int = 3, width: int = 2):
    """A full tree of the given depth and width whose every node is accepted w.p. p_children."""
    parents, depths = [-1], [0]
    frontier = [0]
    for d in range(1, depth + 1):
        nxt = []
        for u in frontier:
            for _ in range(width):
                parents.append(u)
                depths.append(d)
                nxt.append(len(parents) - 1)
        frontier = nxt
    par = torch.tensor(parents)
    return Forecast(acceptance(torch.full((len(parents) - 1,), p_children / width), par), par, torch.tensor(depths))


def test_flat_costs_choose_the_largest_tree_with_a_group_on_every_node():
    pl = Planner(CostProfile.flat(), budgets=log2_budgets(32), group_sizes=[4, 8, 16], block_length=16)
    opt, _ = pl.choose(_forecast(0.9, depth=5), c=100, room=64)
    assert opt.nodes == 32 and opt.groups == 33 and opt.group_size == 16 and not opt.draft_pass


def test_cpu_like_costs_choose_ar_when_drafts_are_rarely_accepted():
    cpu = CostProfile("cpu", "*", "float32", (1, 2, 16, 33, 544), (0,), ((1.0, 1.4, 1.7, 2.1, 15.0),))
    pl = Planner(cpu, budgets=log2_budgets(32), group_sizes=[4, 8, 16], block_length=16)
    assert pl.choose(_forecast(0.1), c=100, room=64)[0] == Option(0)
    # the same costs with drafts that are nearly always right: a tree pays for itself
    opt, table = pl.choose(_forecast(0.98, depth=6), c=100, room=64)
    assert opt.nodes > 0 and table[opt.label] > table["ar"]


def test_rounds_without_marginals_probe_now_and_then_and_less_often_while_losing():
    cpu = CostProfile("cpu", "*", "float32", (1, 16, 544), (0,), ((1.0, 1.7, 15.0),))
    pl = Planner(cpu, budgets=[1, 2, 4], group_sizes=[4], block_length=8, allow_two_pass=False)
    picks = [pl.choose(Forecast(), c=10, room=50)[0] for _ in range(40)]
    probes = [i for i, o in enumerate(picks) if o.groups]
    assert probes and all(o == Option(0) for i, o in enumerate(picks) if i not in probes)
    pl.choose(_forecast(0.05), c=10, room=50)  # the probe's marginals were useless
    assert pl.probe_every > 8


def test_plan_rests_after_a_run_of_ar_choices_without_drafting_anything():
    """plan() owns the rest: after 8 AR choices it answers AR for `rest` rounds without calling
    the forecast (no drafting, no lookups); marginals at hand end the rest early."""
    cpu = CostProfile("cpu", "*", "float32", (1, 16, 544), (0,), ((1.0, 1.7, 15.0),))
    pl = Planner(cpu, budgets=[1, 2, 4], group_sizes=[4], block_length=8, allow_two_pass=False)
    calls = []

    def forecast():
        calls.append(1)
        return _forecast(0.05), None

    for _ in range(8):
        assert pl.plan(forecast, 10, 50, True)[0] == Option(0)
    assert len(calls) == 8 and pl.dormant == 4
    for _ in range(4):
        assert pl.plan(forecast, 10, 50, False) == (Option(0), None)
    assert len(calls) == 8 and pl.dormant == 0
    pl.plan(forecast, 10, 50, False)
    assert len(calls) == 9


def test_auto_greedy_matches_ar_under_any_costs():
    m = tiny_model(seed=1, vocab_size=12)
    p = torch.randint(5, 12, (10,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = generate_ids(m, p, DecodeConfig(mode="ar", max_new_tokens=40), eos_token_id=[])[0]
    cpu = CostProfile("cpu", "*", "float32", (1, 16, 544), (0,), ((1e-3, 1.7e-3, 15e-3),))
    for prof in (CostProfile.flat(), cpu):
        out, st = generate_ids(m, p, DecodeConfig(max_new_tokens=40, block_length=8), eos_token_id=[], profile=prof)
        assert out == ar
        assert sum(st.plan_hist.values()) == st.rounds
    assert any(k != "ar" for k in st.plan_hist) or True


shipped = pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "model.safetensors")), reason="no shipped model")


@shipped
def test_on_the_shipped_model_a_flat_profile_plans_one_pass_presto_with_budget_32():
    import selfspec

    model, tok = selfspec.load()
    with open(os.path.join(SHIPPED, "prompts.jsonl")) as f:
        prompt = json.loads(f.readline())["prompt"]
    dec = Decoder(model, tok.encode(prompt), DecodeConfig(max_new_tokens=48), profile=CostProfile.flat())
    chosen, plan = [], dec.planner.plan

    def recording(*a):
        chosen.append(plan(*a))
        return chosen[-1]

    dec.planner.plan = recording
    rounds = iter(dec)
    next(rounds), next(rounds)  # the prefill's token, then the first round (planned on the prefill's group)
    opt = chosen[0][0]
    assert opt.nodes >= 32 and opt.groups == opt.nodes + 1 and not opt.draft_pass


def test_expected_tokens_of_n_nodes_are_those_of_the_subtree_the_runtime_verifies():
    from selfspec.drafting.tree import Tree, top_nodes

    # index order (depth by depth) differs from score order: node 3 (depth 2) beats node 2 (depth 1)
    tree = Tree(torch.tensor([9, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2]),
                torch.tensor([0.0, -0.1, -3.0, -0.2]))
    acc = torch.tensor([1.0, 0.9, 0.05, 0.8], dtype=torch.float64)
    f = Forecast(acc, tree.parents, tree.depths, tree.scores)
    y = Planner._yields(f, 10**9)
    for n in range(4):
        sub = top_nodes(tree, n)
        kept = [tree.tokens.tolist().index(t) for t in sub.tokens.tolist()]
        assert y[n] == pytest.approx(float(acc[kept].sum()))


def test_layout_labels_of_rounds_settings_and_bench_rows_are_spelled_by_one_function():
    from selfspec.tools.bench import label

    assert [Option(0).label, Option(8).label, Option(8, draft_pass=True).label, Option(8, 9, 16).label,
            Option(10, source="lookup").label] == ["ar", "verify/N=8", "two-pass/N=8", "one-pass/N=8/m=9/G=16",
                                                    "lookup/N=10"]
    presto = DecodeConfig(mode="presto", schedule="one-pass", budget=32, lookup=True)
    assert [config_label(DecodeConfig(mode=m)) for m in ("ar", "lookup", "auto")] == ["ar", "lookup", "auto"]
    assert config_label(DecodeConfig(mode="linear", schedule="two-pass")) == "linear/two-pass"
    assert config_label(presto) == "presto/one-pass/N=32/lookup"
    assert label(presto) == "hybrid/one-pass/N=32" and label(DecodeConfig(mode="linear")) == "linear/one-pass"
