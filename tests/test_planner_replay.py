"""The planner where drafts succeed (issue 78 item 3): every greedy round's tokens judge the whole
forecast tree (`calibration.walked`), a probe comes at the least spacing while the calibrated
forecast says it and the tree it buys beat AR (`choice.probe_pays`), and the replay bounds take
only `auto`'s own options, with and without hindsight (`tools.hindsight`)."""

from types import SimpleNamespace

import pytest
import torch

from selfspec.drafting.replay import Replay, ReplayProfile
from selfspec.drafting.tree import Tree
from selfspec.engine.planning.calibration import Forecast, walked
from selfspec.engine.planning.choice import PROBE_MIN, due_probe, probe_pays
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.round.rounds import AR, Option
from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.planning.planner import Planner, default_group_sizes
from selfspec.tools.hindsight import candidates, commit_odds, expected_steps, hindsight_steps

CFG = DecodeConfig(mode="auto", block_length=8, budget=8)
REF = list(range(10, 110))


def _replay(p, s=0.0):
    return Replay(ReplayProfile("p", [p] * 16, [s] * 16), {0: REF}, {0: [1, 2]}, mask_id=4, top_k=4)


def test_committed_tokens_judge_every_node_of_a_tree_down_to_their_depth():
    tokens, parents = [7, 4, 5, 9], [-1, 0, 0, 1]
    assert walked(tokens, parents, [4, 2]) == ([True, True, True], [True, False, False])
    assert walked(tokens, parents, [4]) == ([True, True, False], [True, False, False])  # depth 2 not known yet
    assert walked(tokens, parents, [5, 9]) == ([True, True, False], [False, True, False])  # 9's parent rejected


def _tree(local: float, depth: int = 3) -> Tree:
    """A chain of `depth` nodes under root 7, tokens 20, 21, ..., each of local score `local`."""
    n = depth + 1
    return Tree(torch.tensor([7] + [20 + i for i in range(depth)]), torch.tensor(list(range(-1, depth))),
                torch.arange(n), torch.arange(n, dtype=torch.float32) * local)


def test_an_ar_round_after_a_probe_teaches_the_calibration_the_probe_s_depth_one_nodes():
    pl = Planner(CostModel.flat(0.1), DecodeConfig(mode="auto", budget=4, block_length=8))
    before = pl.calibrator.reached.sum().item()
    seq = SimpleNamespace(params=SimpleNamespace(temperature=0.0))
    row = SimpleNamespace(big=_tree(-2.2), committed=[20], seq=seq, nodes=0, room=64, marg=object())
    rnd = SimpleNamespace(option=AR, rows=[row], width=1, cache_len=0, model_seconds=0.1, seconds=0.1,
                          plan_seconds=0.0, bare=False, draining=False, join_tokens=0, refresh=False,
                          target_seconds=0.0, target_rows=0)
    pl.observe(rnd)
    assert pl.calibrator.reached.sum().item() == pytest.approx(before + 1)  # depth 1 judged, deeper not yet
    assert pl.calibrator.accepted.sum().item() == pytest.approx(1)
    sampled = SimpleNamespace(**{**vars(row), "seq": SimpleNamespace(params=SimpleNamespace(temperature=1.0))})
    pl.observe(SimpleNamespace(**{**vars(rnd), "rows": [sampled]}))  # a sampled row's tokens judge nothing
    assert pl.calibrator.reached.sum().item() == pytest.approx(before + 1, rel=0.01)


CPU = CostModel.one_row((1, 2, 3, 4, 5, 8, 16), ((1.0, 1.15, 1.4, 1.5, 1.6, 1.9, 3.1),))


def _forecast(tree: Tree) -> Forecast:
    return Forecast(None, tree.parents, tree.depths, tree.scores, "tree")


@pytest.mark.parametrize("local, pays", [(-0.05, True), (-6.0, False)])
def test_a_probe_comes_at_the_least_spacing_only_while_the_calibrated_forecast_says_it_pays(local, pays):
    pl = Planner(CPU, DecodeConfig(mode="auto", budget=4, block_length=8))
    pl.ledger.funds = 1e9
    pl.probe_every = 128  # episodes lost: the spacing by loss alone would wait
    pl.recent_trees = [_forecast(_tree(local))]
    ar = pl.costs.seconds(AR, 1, 10)[1]
    probe = Option(groups=1, group_size=4)
    assert probe_pays(pl, 1, 10, ar, pl.costs.seconds(probe, 1, 10)[1], 3) is pays
    pl.since_probe = PROBE_MIN
    assert (due_probe(pl, 1, 10, [64], ar) is not None) is pays


@pytest.mark.parametrize("local, pays", [(-0.05, True), (-6.0, False)])
def test_a_probe_that_pays_comes_the_round_after_its_verification(local, pays):
    """Where drafts succeed the best cycle is a probe, then a verification of its tree, then a
    probe again (`expected_steps`' policy on a CPU's costs); waiting PROBE_MIN AR rounds between
    them had capped `auto` far below it. A probe that does not pay still waits."""
    pl = Planner(CPU, DecodeConfig(mode="auto", budget=4, block_length=8))
    pl.ledger.funds = 1e9
    pl.recent_trees = [_forecast(_tree(local))]
    ar = pl.costs.seconds(AR, 1, 10)[1]
    pl.since_probe = 1  # the verification round came after the latest probe
    assert (due_probe(pl, 1, 10, [64], ar) is not None) is pays
    pl.since_probe = 0  # never twice in a row: a probe's marginals are verified first
    assert due_probe(pl, 1, 10, [64], ar) is None


def test_one_tree_that_reads_low_does_not_stop_the_probes_the_trees_before_it_paid_for():
    """`probe_pays` reads the latest few marginals' trees, not the last alone: a weak tree at the
    end of a run of good ones (one position's draws) had stopped every probe after it, since no
    probe came to replace it. Trees that all read low still stop them."""
    pl = Planner(CPU, DecodeConfig(mode="auto", budget=4, block_length=8))
    ar = pl.costs.seconds(AR, 1, 10)[1]
    cost = pl.costs.seconds(Option(groups=1, group_size=4), 1, 10)[1]
    good, weak = _forecast(_tree(-0.05)), _forecast(_tree(-6.0))
    pl.recent_trees = [good, good, good, weak]
    assert probe_pays(pl, 1, 10, ar, cost, 3)
    pl.recent_trees = [weak] * 4
    assert not probe_pays(pl, 1, 10, ar, cost, 3)


def test_one_verified_node_outweighs_the_calibration_s_prior():
    """A node's score is not its odds (lambda log rho pushes it down): a depth-1 node of local
    score -2.2 reads 0.32 before any evidence. One round in which such a node was accepted must
    move it most of the way, or the first probes never look worth the next."""
    pl = Planner(CPU, DecodeConfig(mode="auto", budget=4, block_length=8))
    score = torch.tensor([-2.2])
    assert pl.calibrator.prob(score).item() < 0.4
    pl.calibrator.update(score, torch.tensor([True]), torch.tensor([True]))
    assert pl.calibrator.prob(score).item() > 0.75


def test_the_bounds_take_auto_s_options_only():
    cfg = DecodeConfig(mode="auto", block_length=16, budget=32)
    sizes = default_group_sizes(cfg.group)
    for o, paths, needs, leaves in candidates(ReplayProfile("p", [0.9], [0.5]), cfg):
        assert o.draft in ("none", "tree") and (not o.groups or o.group_size in sizes)
        assert all(len(p) <= max(needs, cfg.block_length - 1) for p in paths)  # drafts within the marginals' reach


def test_commit_odds_of_a_chain_match_the_profile_s_expectation():
    prof = ReplayProfile("p", [0.9, 0.3, 0.8, 0.95], [0.5, 0.4, 0.5, 0.5])
    chain = frozenset(tuple([0] * k) for k in range(1, 5))
    odds = commit_odds(prof, chain)
    assert sum(odds.values()) == pytest.approx(1.0)
    assert sum(j * p for j, p in odds.items()) == pytest.approx(prof.expected_tpf(4))


@pytest.mark.parametrize("p", [1.0, 0.0])
def test_certain_outcomes_leave_nothing_for_hindsight_to_know(p):
    cost = CostModel.linear(1e-3, 1e-2)
    args = dict(new_tokens=40, prompt_len=4, cost=cost, cfg=CFG)
    assert expected_steps(_replay(p).profile, **args) == pytest.approx(hindsight_steps(_replay(p), 0, **args))


def test_hindsight_pays_less_than_the_best_planner_without_it():
    cost = CostModel.linear(1e-3, 1e-2)
    rep = _replay(0.6, 0.5)
    args = dict(new_tokens=60, prompt_len=4, cost=cost, cfg=CFG)
    assert hindsight_steps(rep, 0, **args) < expected_steps(rep.profile, **args) < 59
