"""Sampled decoding is exact at every depth: the first four tokens of PRESTO generations (one-pass,
two-pass, with top-k, with top-p) follow the model's own AR distribution position by position,
including tokens drawn at tree nodes of depth 2 (the bonus after two accepted drafts).

The exact per-position marginals come from enumerating every prefix with plain causal forwards;
a chi-square test compares them with 300 seeded generations. A negative control (the same
counts against the temperature-0.5 marginals) shows the test can reject, at depth too."""

import math
import statistics

import pytest
import torch

from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.schedule.decoder import generate_ids
from selfspec.drafting.sampling import process_logits

from conftest import tiny_model

V, SEED = 8, 2  # a small vocabulary: random drafts are often right, so deep nodes get drawn at
N = 300
NEW = 4  # prefill token, then one round that can reach depth 2 (two drafts + the bonus)
PROMPT = torch.randint(5, V, (6,), generator=torch.Generator().manual_seed(11)).tolist()
TREE = dict(mode="presto", schedule="one-pass", block_length=4, budget=8, tree_top_k=3, group_size=4, group_nodes=None, lam=0.2,
            rho="ngram", draft_lora=True, max_new_tokens=NEW, temperature=1.0)
CASES = {
    "presto one-pass": dict(schedule="one-pass"),
    "presto two-pass": dict(schedule="two-pass"),
    "presto one-pass top-k 4": dict(schedule="one-pass", top_k=4),
    "presto two-pass top-p 0.8": dict(schedule="two-pass", top_p=0.8),
    # plan auto on a GPU-like (flat) profile: planned one-pass trees with context candidates
    "auto, flat profile": dict(mode="auto"),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=SEED, vocab_size=V)


def exact_marginals(model, prompt, n, *, temperature=1.0, top_k=0, top_p=1.0) -> list[torch.Tensor]:
    """P(token at position k) for k < n, summed over every prefix, with the runtime's filtering."""
    prefixes, weights, out = [[]], torch.ones(1), []
    with torch.inference_mode():
        for k in range(n):
            logits = model(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
            probs = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                                   banned=model.config.mask_token_id).softmax(-1)
            joint = weights[:, None] * probs
            out.append(joint.sum(0))
            keep = (joint > 1e-12).nonzero().tolist()
            prefixes = [prefixes[i] + [t] for i, t in keep]
            weights = torch.tensor([float(joint[i, t]) for i, t in keep])
    return out


def chi2(observed: torch.Tensor, expected: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells expecting < 5 are pooled into one."""
    exp = expected * n
    big = exp >= 5
    stat = float((((observed - exp) ** 2) / exp)[big].sum())
    rest_o, rest_e = float(observed[~big].sum()), float(exp[~big].sum())
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
    elif rest_o > 0:
        stat = math.inf  # a token the model never produces (e.g. the mask id)
    return stat, int(big.sum()) + (rest_e > 0) - 1


def critical(df: int, z: float = 3.09, *, checks: int = 1) -> float:
    """Wilson-Hilferty chi-square quantile; z = 3.09 is p = 0.001. critical(20) ~ 45.3. A test that
    checks several positions (`checks`) takes each at p = 0.001 / checks (Bonferroni), so that the
    test as a whole rejects an exact sampler with probability 0.001 at most."""
    if checks > 1:
        z = statistics.NormalDist().inv_cdf(1 - 0.001 / checks)
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _sample(model, cfg):
    from selfspec.engine.measure.cost import CostModel

    gen = torch.Generator().manual_seed(1234)
    outs, first_round = [], []
    extra = dict(profile=CostModel.flat()) if cfg.mode == "auto" else {}
    for _ in range(N):
        # every run plans afresh: a planner kept from earlier runs has learnt that this CPU's wide
        # rounds cost more than the flat profile says, and turns to AR
        model.__dict__.pop("_selfspec_planners", None)
        out, st = generate_ids(model, PROMPT, cfg, eos_token_id=[], generator=gen, **extra)
        outs.append(out)
        first_round.append(st.accept_lengths[0])
    return torch.tensor(outs), torch.tensor(first_round)


@pytest.mark.parametrize("case", list(CASES))
def test_sampled_tokens_at_every_depth_follow_the_exact_ar_distribution(model, case):
    cfg = DecodeConfig(**{**TREE, **CASES[case]})
    outs, first_round = _sample(model, cfg)
    exact = exact_marginals(model, PROMPT, NEW, top_k=cfg.top_k, top_p=cfg.top_p)
    wrong = exact_marginals(model, PROMPT, NEW, temperature=0.5, top_k=cfg.top_k, top_p=cfg.top_p)
    for k in range(NEW):
        counts = torch.bincount(outs[:, k], minlength=V).float()
        stat, df = chi2(counts, exact[k], N)
        assert stat < critical(df, checks=NEW), (k, stat, df)
        if k == 2 and cfg.mode != "auto":  # negative control (its power is shown once per fixed layout)
            w_stat, w_df = chi2(counts, wrong[k], N)
            assert w_stat > critical(w_df, checks=NEW), (w_stat, w_df)
    # this model really accepts drafts here: a share of position-3 tokens was drawn at depth 2
    # (auto plans AR for part of its first rounds, so fewer of its samples come from deep nodes)
    deep, floor = (first_round >= 2).sum(), (N // 20 if cfg.mode == "auto" else N // 4)
    assert deep > floor and (first_round == 3).sum() > (0 if cfg.mode == "auto" else N // 20), first_round.bincount()
