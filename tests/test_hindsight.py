"""The replay hindsight bound (`tools.hindsight`): the least cost of a generation's tokens with one
candidate layout per round, knowing each round's replayed outcome; and a run's own rounds priced
in the same units."""

import pytest

from selfspec.drafting.replay import Replay, ReplayProfile
from selfspec.engine.measure.cost import CostModel
from selfspec.engine.round.rounds import AR, Option
from selfspec.engine.request.options import DecodeConfig
from selfspec.tools.hindsight import committed, hindsight_steps, modeled_steps, option_of, rank_tree

REF = list(range(10, 110))
CFG = DecodeConfig(mode="auto", block_length=8, budget=8)


def _replay(p, s=0.0):
    return Replay(ReplayProfile("p", [p] * 16, [s] * 16), {0: REF}, {0: [1, 2]}, mask_id=4, top_k=4)


def test_certain_drafts_on_flat_costs_take_the_longest_one_pass_chain_every_round():
    plan = {}
    steps = hindsight_steps(_replay(1.0), 0, new_tokens=57, prompt_len=4, cost=CostModel.flat(), cfg=CFG, plan=plan)
    assert steps == 7  # 56 tokens, 8 a round (7 drafts and the bonus), one AR step each
    assert sum(plan.values()) == 7 and all("N=7" in k or "N=8" in k for k in plan)


def test_impossible_drafts_leave_ar_the_bound():
    plan = {}
    assert hindsight_steps(_replay(0.0), 0, new_tokens=30, prompt_len=4, cost=CostModel.linear(1e-3, 1e-2), cfg=CFG,
                           plan=plan) == pytest.approx(29)
    assert plan == {"ar": 29}


def test_a_round_commits_the_path_of_the_true_tokens_ranks_that_its_tree_holds():
    rep = _replay(0.5, 0.5)
    outcomes = [rep.outcome(0, 4 + d, d) for d in range(1, 9)]
    chain = frozenset(tuple([0] * k) for k in range(1, 8))
    run = next((i for i, o in enumerate(outcomes) if o != 0), 8)
    assert committed(rep, 0, 5, chain) == min(run, 7) + 1
    tree = rank_tree(rep.profile, 20)
    assert (0,) in tree and (1,) in tree and all(p[:-1] in tree for p in tree if len(p) > 1)  # prefix-closed


def test_a_run_s_rounds_are_priced_by_their_layouts():
    cost = CostModel.linear(1e-3, 1e-2)
    o = Option("tree", 4, 5, 8)
    assert option_of(o.label) == o and option_of("ar") == AR
    assert option_of(Option("chain", 3, draft_pass=True).label) == Option("chain", 3, draft_pass=True)
    got = modeled_steps([(o.label, 10), ("ar", 11)], CFG, cost, 4)
    assert got == pytest.approx(cost.ar_steps(o, block_length=8, cache=10) + 1)


def test_bench_replay_is_greedy_and_one_prompt_at_a_time():
    from types import SimpleNamespace

    from selfspec.tools.hindsight import replay_arg

    def args(**kw):
        return SimpleNamespace(**{"replay": "nld-8b", "temperature": None, "temperatures": [0.0, 1.0], "argv": [], **kw})

    a = args()
    assert replay_arg(a, False).name == "nld-8b" and a.temperatures == [0.0]  # the default pair becomes greedy
    with pytest.raises(ValueError, match="needs temperature 0"):
        replay_arg(args(temperature=1.0), False)
    with pytest.raises(ValueError, match="not with --batch-sizes"):
        replay_arg(args(), True)
    with pytest.raises(ValueError, match="unknown replay profile"):
        replay_arg(args(replay="nld-99b"), False)
    assert replay_arg(args(replay=None), False) is None
