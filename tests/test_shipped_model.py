"""The model the project ships: loads offline, tokenises code exactly, writes Python, and every
decoding mode reproduces its AR greedy output."""

import json
import os

import pytest

from selfspec.engine.request.options import DecodeConfig
from selfspec.engine.schedule.decoder import generate_ids

from conftest import SHIPPED

pytestmark = pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "model.safetensors")),
                                reason="the shipped model is not in this checkout")


@pytest.fixture(scope="module")
def shipped(default_model):
    return default_model


@pytest.fixture(scope="module")
def prompts():
    with open(os.path.join(SHIPPED, "prompts.jsonl")) as f:
        return [json.loads(line)["prompt"] for line in f]


def test_load_without_arguments_returns_the_shipped_model_offline(shipped):
    model, tok = shipped
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    assert model.config.model_type == "nemotron_labs_diffusion"
    assert len(tok) == model.config.vocab_size and model.config.mask_token_id == 4


def test_tokenizer_round_trip_on_real_code_is_exact(shipped):
    _, tok = shipped
    here = os.path.dirname(os.path.abspath(__file__))
    texts = [open(os.path.join(here, "..", "selfspec", name), encoding="utf-8").read() for name in ("engine/schedule/decoder.py", "drafting/tree.py")]
    texts.append("def f(x):\n\tif x:  # naïve — 中文\n        return  x\r\n\n\n")
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_greedy_continuation_is_python_not_a_repeated_token(shipped, prompts):
    model, tok = shipped
    out, _ = generate_ids(model, tok.encode(prompts[0]), DecodeConfig(mode="ar", max_new_tokens=48))
    assert len(set(out)) >= 8
    text = tok.decode(out)
    assert any(k in text for k in ("self", "return", "(", "=", "if ", "for ")), text


def test_prompt_set_has_at_least_50_held_out_prompts(prompts):
    assert len(prompts) >= 50


@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
@pytest.mark.parametrize("block", [4, 8, 16])
def test_linear_greedy_matches_ar_on_the_shipped_model(shipped, prompts, schedule, block):
    model, tok = shipped
    for p in prompts[1:3]:
        ids = tok.encode(p)
        ar, _ = generate_ids(model, ids, DecodeConfig(mode="ar", max_new_tokens=32))
        out, st = generate_ids(model, ids, DecodeConfig(mode="linear", schedule=schedule, block_length=block, max_new_tokens=32))
        assert out == ar


@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
@pytest.mark.parametrize("budget", [1, 4, 16, 64])
def test_presto_greedy_matches_ar_on_the_shipped_model(shipped, prompts, schedule, budget):
    model, tok = shipped
    ids = tok.encode(prompts[3])
    ar, _ = generate_ids(model, ids, DecodeConfig(mode="ar", max_new_tokens=32))
    out, st = generate_ids(model, ids, DecodeConfig(mode="presto", schedule=schedule, budget=budget, group_size=8,
                                                    block_length=8, max_new_tokens=32))
    assert out == ar
    assert st.tau > 1.0  # a trained model's drafts are accepted
