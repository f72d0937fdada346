"""Acceptance replay (`drafting.replay`): the draft marginals replaced by a profile's calibrated
ones, drawn against the greedy AR output. A certain profile accepts every draft, an impossible
one none; the synthetic marginals hit at the profile's rates and state them; the output is the
model's own (AR's) in every mode and weight format; bad profiles are one clear error."""

import json
import math
import os

import pytest
import torch

import selfspec
from selfspec.drafting.replay import Replay, ReplayProfile, load_profile
from selfspec.drafting.tree import Marginals
from selfspec.streaming import encode_prompt

from conftest import SHIPPED
from matrix import FORMATS

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny model: one thread (conftest)

PROMPT = "def add(a, b):\n    return"
_MODELS = {}


def _model(fmt="fp32"):
    if fmt not in _MODELS:
        _MODELS[fmt] = selfspec.load(SHIPPED, weights=fmt, progress=False)
    return _MODELS[fmt]


def flat(name, p, s=0.0, depths=31):
    return ReplayProfile(name, [p] * depths, [s] * depths)


@pytest.mark.parametrize("schedule", ["one-pass", "two-pass"])
def test_a_certain_profile_accepts_every_draft(schedule):
    m, tok = _model()
    B, rounds = 8, 3
    g = selfspec.generate(m, tok, PROMPT, mode="linear", schedule=schedule, block_length=B,
                          max_new_tokens=1 + rounds * B, eos_token_id=[], replay=flat("sure", 1.0))
    assert g.stats.accept_lengths == [B] * rounds  # every draft and the bonus
    assert g.stats.tau == B  # block / the most a round can commit
    assert g.stats.replay == "sure" and g.stats.as_dict()["replay"] == "sure"
    assert 0 < g.stats.replay_seconds < g.stats.seconds  # said apart: a real drafter never spends it


def test_an_impossible_profile_accepts_no_draft():
    m, tok = _model()
    g = selfspec.generate(m, tok, PROMPT, mode="linear", block_length=8, max_new_tokens=12, eos_token_id=[],
                          replay=flat("never", 0.0))
    assert g.stats.accept_lengths == [1] * g.stats.rounds and g.stats.tau == 1.0  # the bonus alone


def test_the_synthetic_marginals_hit_at_the_profile_rates_and_state_them():
    """Per depth, the true token is the top-1 candidate at rate top1 and the second at
    (1 - top1) * rank2, within 4 binomial standard deviations; the stated probabilities are those
    rates and the whole marginal sums to one (calibrated)."""
    V, D, n = 50, 6, 1500
    prof = ReplayProfile("mixed", [0.9, 0.7, 0.5, 0.35, 0.6, 0.2], [0.5, 0.6, 0.5, 0.5, 0.2, 0.25])
    gen = torch.Generator().manual_seed(0)
    ref = torch.randint(5, V, (n + D,), generator=gen).tolist()
    rep = Replay(prof, {0: ref}, {0: [1, 2, 3]}, mask_id=4, top_k=4, seed=7)
    blank = Marginals(torch.zeros(D, 4), torch.zeros(D, 4, dtype=torch.long), torch.zeros(D, V))
    hits = torch.zeros(D, 2)
    for at in range(n):
        marg = rep.marginals(blank, 0, at, 1)
        true = torch.tensor(ref[at : at + D])
        hits += (marg.top_tok[:, :2] == true[:, None]).float()
        if at < 20:
            q = marg.logq.exp()
            assert torch.allclose(q.sum(-1), torch.ones(D), atol=1e-4)
            assert q[:, 4].max() == 0  # never the mask
            assert len(set(marg.top_tok[0].tolist())) == 4
    for k in range(D):
        p1, s = prof.top1[k], prof.rank2[k]
        for got, rate in ((hits[k, 0] / n, p1), (hits[k, 1] / n, (1 - p1) * s)):
            sd = math.sqrt(rate * (1 - rate) / n)
            assert abs(float(got) - rate) <= 4 * sd + 1e-9, (k, float(got), rate)
        stated = rep.marginals(blank, 0, 0, 1).top_lq[k, :2].exp()
        assert torch.allclose(stated, torch.tensor([p1, (1 - p1) * s]), atol=1e-5)


def test_draws_are_keyed_by_prompt_position_and_depth():
    """The same (prompt, position, depth) draws the same outcome whatever asks; another prompt
    draws its own (prompts must not share one pattern of outcomes)."""
    prof = flat("half", 0.5, 0.5, 8)
    ref = list(range(10, 60))
    blank = Marginals(torch.zeros(8, 4), torch.zeros(8, 4, dtype=torch.long), torch.zeros(8, 64))
    a = Replay(prof, {0: ref, 1: ref}, {0: [1, 2], 1: [1, 3]}, mask_id=4, top_k=4)
    first = a.marginals(blank, 0, 5, 1).top_tok
    assert torch.equal(first, a.marginals(blank, 0, 5, 1).top_tok)
    assert torch.equal(first[1:], a.marginals(blank, 0, 6, 2).top_tok[:-1])  # position 6 at depth 2 either way
    outcomes = [[int(x == t) for x, t in zip(a.marginals(blank, r, at, 1).top_tok[:, 0].tolist(), ref[at:])]
                for r in (0, 1) for at in (0, 8, 16, 24)]
    assert outcomes[:4] != outcomes[4:]


MODES = {
    "ar": dict(mode="ar"),
    "linear one-pass": dict(mode="linear", schedule="one-pass"),
    "linear two-pass": dict(mode="linear", schedule="two-pass"),
    "presto one-pass": dict(mode="presto", schedule="one-pass", budget=16),
    "presto two-pass": dict(mode="presto", schedule="two-pass", budget=16),
    "lookup": dict(mode="lookup"),
    "auto": dict(mode="auto"),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_replay_never_changes_the_greedy_output(fmt):
    m, tok = _model(fmt)
    ar = selfspec.generate(m, tok, PROMPT, mode="ar", max_new_tokens=20, eos_token_id=[]).token_ids
    for name, opts in MODES.items():
        for prof in ("nld-8b", flat("coin", 0.5, 0.5)):
            g = selfspec.generate(m, tok, PROMPT, block_length=8, max_new_tokens=20, eos_token_id=[],
                                  replay=prof, **opts)
            assert g.token_ids == ar, (fmt, name, prof)
            assert g.stats.replay == load_profile(prof).name


PUBLISHED_TPF = {8: 3.21, 16: 4.75, 32: 5.96}  # NLD-8B linear self-speculation, ../shared/spec/nld-acceptance.md


def _walked_tpf(prof, block, *, prompts=64, new_tokens=512):
    """Replayed one-pass linear tokens per forward walked from the draws (`Replay.linear_tpf`)
    over `prompts` prompt keys: what the measuring run (docs/replay.md) commits, without a model."""
    rep = Replay(prof, {i: [0] * new_tokens for i in range(prompts)}, {i: [i] for i in range(prompts)},
                 mask_id=4, top_k=4)
    runs = [rep.linear_tpf(i, new_tokens=new_tokens, block=block) for i in range(prompts)]
    return sum(t for t, _ in runs) / sum(r for _, r in runs)


def test_the_nld_8b_profile_is_fitted_to_the_published_tokens_per_forward():
    """Replayed linear tokens per forward at blocks 8 / 16 / 32 (64 prompts of 512 tokens, the
    measuring run's shape) are within 10% of NLD-8B's published 3.21 / 4.75 / 5.96, and the
    expectation (B - 1 drafts, no answer's end) within 2%, the fit's own claim; the measured
    ones are in docs/replay.md."""
    prof = load_profile("nld-8b")
    for B, published in PUBLISHED_TPF.items():
        assert abs(prof.expected_tpf(B - 1) / published - 1) <= 0.02, B
        assert abs(_walked_tpf(prof, B) / published - 1) <= 0.10, B
    assert prof.top1[0] == 0.949  # the published position-1 agreement
    assert prof.rank2[0] == 0.575 and sum(s == 0.575 for s in prof.rank2) == len(prof.rank2) - 1  # published share


def test_a_replayed_linear_run_commits_what_the_draws_walk_to():
    """The walk the fit is judged by is what the model's replayed run commits, round by round."""
    m, tok = _model()
    prof = load_profile("nld-8b")
    for B in (8, 16):
        g = selfspec.generate(m, tok, PROMPT, mode="linear", schedule="one-pass", block_length=B,
                              max_new_tokens=80, eos_token_id=[], replay=prof)
        ar = selfspec.generate(m, tok, PROMPT, mode="ar", max_new_tokens=80, eos_token_id=[]).token_ids
        rep = Replay(prof, {0: ar}, {0: encode_prompt(tok, PROMPT)}, mask_id=int(m.config.mask_token_id), top_k=4)
        emitted, walked = 1, []
        while emitted < 80:
            walked.append(min(rep.linear_commits(0, emitted, B - 1), 80 - emitted))
            emitted += walked[-1]
        assert g.stats.accept_lengths == walked, B
        assert (sum(walked), len(walked)) == rep.linear_tpf(0, new_tokens=80, block=B)


def test_a_profile_file_loads(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"name": "mine", "top1": [0.8, 0.6], "rank2": [0.5, 0.5]}))
    prof = load_profile(str(path))
    assert prof == ReplayProfile("mine", (0.8, 0.6), (0.5, 0.5)) and load_profile(prof) is prof


@pytest.mark.parametrize("spec, err", [
    ("nld-99b", "unknown replay profile 'nld-99b'"),
    ("missing.json", "unknown replay profile 'missing.json'"),
    ({"top1": [0.5]}, "expected an object with 'top1' and 'rank2'"),
    ({"top1": [0.5], "rank2": [0.5, 0.5]}, "non-empty lists of one length"),
    ({"top1": [1.5], "rank2": [0.5]}, "must lie in [0, 1]"),
    ({"top1": [0.2], "rank2": [0.9]}, "exceeds the first's"),
    ({"top1": ["x"], "rank2": [0.5]}, "must be lists of numbers"),
    ("{not json", "cannot read it as JSON"),
])
def test_a_bad_profile_is_one_clear_error(tmp_path, spec, err):
    if not isinstance(spec, str) or spec.startswith("{"):
        path = tmp_path / "bad.json"
        path.write_text(spec if isinstance(spec, str) else json.dumps({"name": "bad", **spec}))
        spec = str(path)
    with pytest.raises(ValueError) as e:
        load_profile(spec)
    assert err in str(e.value) and "\n" not in str(e.value)


def test_bad_replay_requests_fail_before_any_work():
    m, tok = _model()
    with pytest.raises(TypeError, match="replay must be a profile name"):
        selfspec.generate(m, tok, PROMPT, replay=3)
    with pytest.raises(ValueError, match="needs temperature 0"):
        selfspec.generate(m, tok, PROMPT, replay="nld-8b", temperature=1.0, seed=0)
    with pytest.raises(ValueError, match="unknown replay profile"):
        selfspec.generate(m, tok, PROMPT, replay="no-such-profile")


def test_the_cli_says_the_acceptance_is_replayed(capsys):
    from selfspec.tools.cli import main

    assert main(["generate", "--model", SHIPPED, "--prompt", PROMPT, "--mode", "linear", "--max-new-tokens", "9",
                 "--replay", "nld-8b", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["replay"] == "nld-8b" and rec["note"] == "replayed acceptance (profile nld-8b)"
    assert main(["generate", "--model", SHIPPED, "--prompt", PROMPT, "--max-new-tokens", "4",
                 "--replay", "nld-8b"]) == 0
    assert "replayed acceptance (profile nld-8b)" in capsys.readouterr().err
    assert main(["generate", "--model", SHIPPED, "--prompt", PROMPT, "--replay", os.path.join("no", "such.json")]) == 2
    assert "unknown replay profile" in capsys.readouterr().err
