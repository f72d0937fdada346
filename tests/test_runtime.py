import math
from collections import Counter

import pytest
import torch

from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.schedule.decoder import Decoder, generate_ids

from conftest import tiny_model

# (vocab, seed): small vocabularies make random drafts partly right, so accepted runs, tree
# branches and bonus tokens are all exercised; 64 never accepts a draft, so it serves only the
# tests that do not need acceptance. Every exactness case asserts its own acceptance.
MODELS = {(8, 0): None, (8, 2): None, (12, 1): None, (64, 0): None}
LINEAR_EXACT = [(8, 0), (12, 1)]  # (8, 2) accepts no linear draft on this prompt at B >= 8
PRESTO_EXACT = [(8, 0), (8, 2), (12, 1)]


def _model(key):
    if MODELS[key] is None:
        MODELS[key] = tiny_model(seed=key[1], vocab_size=key[0])
    return MODELS[key]


def _prompt(V, n=10, seed=0):
    return torch.randint(5, V, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ar(model, prompt, n):
    return generate_ids(model, prompt, DecodeConfig(mode="ar", max_new_tokens=n), eos_token_id=[])[0]


def _accepted_drafts(st) -> int:
    """Rounds that accepted at least one draft token (a bonus alone is 1)."""
    return sum(a > 1 for a in st.accept_lengths)


@pytest.mark.parametrize("key", LINEAR_EXACT)
@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
@pytest.mark.parametrize("block", [4, 8, 16])
def test_linear_greedy_matches_ar(key, schedule, block):
    m = _model(key)
    p = _prompt(key[0])
    ar = _ar(m, p, 40)
    out, st = generate_ids(m, p, DecodeConfig(mode="linear", schedule=schedule, block_length=block, max_new_tokens=40), eos_token_id=[])
    assert out == ar
    assert _accepted_drafts(st) >= 2  # the comparison could have failed: drafts were accepted
    assert st.new_tokens == 40 and sum(st.accept_lengths) == st.round_tokens == 39 and max(st.accept_lengths) <= block


@pytest.mark.parametrize("key", PRESTO_EXACT)
@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_presto_greedy_matches_ar(key, schedule, budget):
    m = _model(key)
    p = _prompt(key[0], seed=3)
    ar = _ar(m, p, 40)
    for rho, lam in (("ngram", 0.2), ("none", 0.0)):
        cfg = DecodeConfig(mode="presto", schedule=schedule, block_length=8, budget=budget, rho=rho, lam=lam, max_new_tokens=40)
        out, st = generate_ids(m, p, cfg, eos_token_id=[])
        assert out == ar
        assert _accepted_drafts(st) >= 2  # the comparison could have failed: drafts were accepted
        assert len(st.oracle_lengths) == len(st.accept_lengths) == st.rounds
        assert all(o >= a for o, a in zip(st.oracle_lengths, st.accept_lengths))


def test_one_pass_runs_one_forward_per_round_and_two_pass_counts_both_passes():
    m = _model((8, 0))
    p = _prompt(8)
    one = generate_ids(m, p, DecodeConfig(mode="linear", schedule="one-pass", block_length=8, max_new_tokens=30), eos_token_id=[])[1]
    two = generate_ids(m, p, DecodeConfig(mode="linear", schedule="two-pass", block_length=8, max_new_tokens=30), eos_token_id=[])[1]
    for st in (one, two):
        assert _accepted_drafts(st) >= 1 and st.rounds < 29  # fewer rounds than tokens: tau > 1 for real
        assert sum(st.accept_lengths) == st.round_tokens == 29 and st.tau == pytest.approx(29 / st.rounds)
    assert one.forwards == one.rounds and one.tpf == pytest.approx(29 / one.rounds)
    assert two.forwards == 2 * two.rounds and two.tpf == pytest.approx(29 / (2 * two.rounds))


@pytest.mark.parametrize("mode,schedule", [("ar", "two-pass"), ("linear", "two-pass"), ("linear", "one-pass"), ("presto", "one-pass"), ("presto", "two-pass")])
def test_eos_inside_an_accepted_run_stops_there(mode, schedule):
    m = _model((12, 1))  # greedy output repeats one token: long accepted runs
    p = _prompt(12)
    ar = _ar(m, p, 30)
    eos = ar[5]
    out, _ = generate_ids(m, p, DecodeConfig(mode=mode, schedule=schedule, block_length=8, max_new_tokens=30), eos_token_id=eos)
    assert out == ar[: ar.index(eos) + 1]


@pytest.mark.parametrize("mode,schedule", [("ar", "two-pass"), ("linear", "one-pass"), ("presto", "two-pass"), ("presto", "one-pass")])
@pytest.mark.parametrize("n", [1, 2, 7])
def test_max_new_tokens_is_never_exceeded(mode, schedule, n):
    m = _model((12, 1))
    p = _prompt(12)
    out, st = generate_ids(m, p, DecodeConfig(mode=mode, schedule=schedule, block_length=8, max_new_tokens=n), eos_token_id=[])
    assert out == _ar(m, p, n) and len(out) == n == st.new_tokens


@pytest.mark.parametrize("mode,schedule", [("linear", "two-pass"), ("presto", "one-pass")])
def test_same_seed_same_sampled_output(mode, schedule):
    m = _model((64, 0))
    p = _prompt(64)
    cfg = DecodeConfig(mode=mode, schedule=schedule, block_length=8, max_new_tokens=30, temperature=1.0, top_p=0.9)
    runs = [generate_ids(m, p, cfg, eos_token_id=[], generator=torch.Generator().manual_seed(s))[0] for s in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def _chi2_critical(df: int, z: float = 3.09) -> float:
    # Wilson-Hilferty approximation of the chi-square quantile; z = 3.09 is p = 0.001
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _exact_first_two(model, prompt, temperature=1.0):
    with torch.inference_mode():
        p1 = (model(torch.tensor([prompt])).logits[0, -1] / temperature).softmax(-1)
        V = p1.shape[0]
        seqs = torch.tensor([prompt + [t] for t in range(V)])
        p2 = (model(seqs).logits[:, -1] / temperature).softmax(-1)
    joint = p1[:, None] * p2
    joint[model.config.mask_token_id, :] = 0  # the runtime never emits the mask id
    joint[:, model.config.mask_token_id] = 0
    return joint / joint.sum()


def _chi2(counts: Counter, expected: torch.Tensor, n: int) -> tuple[float, int]:
    exp = expected.reshape(-1) * n
    obs = torch.zeros_like(exp)
    V = expected.shape[0]
    for (a, b), c in counts.items():
        obs[a * V + b] = c
    big = exp >= 5
    stat = float((((obs - exp) ** 2) / exp)[big].sum())
    rest_o, rest_e = float(obs[~big].sum()), float(exp[~big].sum())
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
    return stat, int(big.sum()) + (rest_e > 0) - 1


@pytest.mark.parametrize("mode,schedule", [("linear", "two-pass"), ("linear", "one-pass"), ("presto", "one-pass")])
def test_sampled_first_two_tokens_follow_the_exact_ar_distribution(mode, schedule):
    m = _model((8, 2))
    p = _prompt(8, n=6, seed=11)
    exact = _exact_first_two(m, p)
    gen = torch.Generator().manual_seed(1234)
    cfg = DecodeConfig(mode=mode, schedule=schedule, block_length=4, max_new_tokens=3, temperature=1.0, budget=6)
    n = 2000
    counts, accepted = Counter(), 0
    for _ in range(n):
        out, st = generate_ids(m, p, cfg, eos_token_id=[], generator=gen)
        counts[tuple(out[:2])] += 1
        accepted += st.accept_lengths[0] > 1
    stat, df = _chi2(counts, exact, n)
    assert stat < _chi2_critical(df), (stat, df)
    assert accepted > n // 20  # drafts really were accepted, not just bonus tokens
    # the same counts against a wrong distribution (temperature 0.7) must fail: the test has power
    wrong, _ = _chi2(counts, _exact_first_two(m, p, temperature=0.7), n)
    assert wrong > _chi2_critical(df)


def test_a_consumer_that_stops_early_leaves_the_runtime_reusable():
    m = _model((12, 1))
    p = _prompt(12)
    cfg = DecodeConfig(mode="presto", schedule="one-pass", block_length=8, max_new_tokens=30)
    dec = Decoder(m, p, cfg, eos_token_id=[])
    it = iter(dec)
    _, first = next(it)
    it.close()
    assert first and dec.stats[0].new_tokens == len(first)  # the stats hold what was emitted, no more
    assert generate_ids(m, p, cfg, eos_token_id=[])[0] == _ar(m, p, 30)


@pytest.mark.parametrize(
    "kwargs, prompt, match",
    [
        (dict(), [], "empty prompt"),
        (dict(max_new_tokens=250), [5] * 10, "max_position_embeddings"),
        (dict(mode="beam"), [5], "unknown mode"),
        (dict(schedule="three-pass"), [5], "unknown schedule"),
        (dict(block_length=1), [5], "block_length"),
        (dict(temperature=-1.0), [5], "temperature"),
        (dict(top_p=0.0), [5], "top_p"),
        (dict(top_p=1.5), [5], "top_p"),
    ],
)
def test_bad_requests_fail_before_any_model_work(kwargs, prompt, match):
    class Exploding(torch.nn.Module):
        def __init__(self, real):
            super().__init__()
            self.config = real.config
            self.emb = real.get_input_embeddings()

        def get_input_embeddings(self):
            return self.emb

        def forward(self, *a, **k):
            raise AssertionError("model work started")

    m = Exploding(_model((64, 0)))
    with pytest.raises(ValueError, match=match):
        generate_ids(m, prompt, DecodeConfig(**{"mode": "linear", **kwargs}))


@pytest.mark.parametrize("mode", ["linear", "presto"])
@pytest.mark.parametrize("group_nodes", [1, 2, 5])
def test_one_pass_with_groups_on_few_nodes_still_matches_ar(mode, group_nodes):
    for key in [(8, 0), (8, 2), (12, 1)]:
        m = _model(key)
        p = _prompt(key[0], seed=4)
        cfg = DecodeConfig(mode=mode, schedule="one-pass", block_length=8, budget=12, group_nodes=group_nodes, max_new_tokens=40)
        out, st = generate_ids(m, p, cfg, eos_token_id=[])
        assert out == _ar(m, p, 40)
        assert st.forwards == st.rounds
