"""Real NLD on-disk format end to end, on a tiny checkpoint: shards, index, auto_map, generation
config eos list, an HF tokenizer with a chat template, and a linear_spec_lora/ adapter."""

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import selfspec
from selfspec.checkpoint.lora import load_draft_lora
from selfspec.engine.forward.masks import tree_and_groups
from selfspec.engine.schedule.decoder import generate_ids
from selfspec.streaming import encode_prompt
from selfspec.engine.request.options import DecodeConfig

from conftest import tiny_model
from test_model import _write_sharded_bf16

WORDS = ["def", "return", "x", "y", "(", ")", ":", "+", "=", "if", "else", "for", "in", "print", "hi", "hello"]
TEMPLATE = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}{% if add_generation_prompt %} answer{% endif %}"


def _hf_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "<mask_reserved>": 4, "[INST]": 5, "[/INST]": 6, "answer": 7}
    for w in WORDS:
        vocab[w] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", chat_template=TEMPLATE)
    fast.save_pretrained(path)


def _lora(model, path, r=4, alpha=8.0, bad=False):
    os.makedirs(path / "linear_spec_lora", exist_ok=True)
    (path / "linear_spec_lora" / "adapter_config.json").write_text(
        json.dumps({"r": r, "lora_alpha": alpha, "target_modules": ["o_proj"], "peft_type": "LORA"}))
    g = torch.Generator().manual_seed(0)
    w = {}
    for i, layer in enumerate(model.encoder.layers):
        o = layer.self_attn.o_proj
        a = torch.randn(r, o.in_features + (1 if bad and i == 1 else 0), generator=g)
        w[f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_A.weight"] = a
        w[f"base_model.model.encoder.layers.{i}.self_attn.o_proj.lora_B.weight"] = torch.randn(o.out_features, r, generator=g)
    save_file(w, path / "linear_spec_lora" / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def real_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("nld")
    model = tiny_model(seed=3, vocab_size=32, eos_token_id=2)
    _write_sharded_bf16(model, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    _hf_tokenizer(path)
    _lora(model, path)
    return path


def test_tokenizer_chat_template_and_eos_lists_come_from_the_checkpoint(real_dir):
    model, tok = selfspec.load(real_dir)
    ids = encode_prompt(tok, [{"role": "user", "content": "def x"}])
    assert tok.convert_ids_to_tokens(ids)[-1] == "answer" and "[INST]" in tok.convert_ids_to_tokens(ids)
    assert model.config.eos_token_id == [2, 7]
    assert model.config.mask_token_id == 4  # from the config, never from the tokenizer
    assert model.dtype == torch.float32


def test_draft_lora_changes_marginals_but_never_verification_logits(real_dir):
    model, _ = selfspec.load(real_dir)
    lora = model.draft_lora
    assert lora is not None and lora.scale == 2.0
    tree_parents, depths = torch.tensor([-1, 0, 0, 1]), torch.tensor([0, 1, 1, 2])
    lay = tree_and_groups(0, tree_parents, depths, torch.tensor([0, 3]), 3)
    ids = torch.tensor([[8, 9, 10, 11] + [4] * 6])
    with torch.inference_mode():
        plain = model(ids, position_ids=lay.positions, attention_mask=lay.mask).logits[0]
        with lora.on(slice(4, None)):
            drafted = model(ids, position_ids=lay.positions, attention_mask=lay.mask).logits[0]
    assert torch.equal(plain[:4], drafted[:4])  # verification rows exact
    assert (plain[4:] - drafted[4:]).abs().max() > 1e-3  # draft rows changed


@pytest.mark.parametrize("schedule", ["two-pass", "one-pass"])
@pytest.mark.parametrize("mode", ["linear", "presto"])
def test_greedy_with_the_draft_lora_still_equals_ar(real_dir, schedule, mode):
    model, _ = selfspec.load(real_dir)
    prompt = [8, 9, 10, 11, 12]
    ar, _ = generate_ids(model, prompt, DecodeConfig(mode="ar", max_new_tokens=24), eos_token_id=[])
    for use in (True, False):
        cfg = DecodeConfig(mode=mode, schedule=schedule, block_length=6, max_new_tokens=24, draft_lora=use)
        assert generate_ids(model, prompt, cfg, eos_token_id=[])[0] == ar


def test_mismatched_lora_shapes_are_a_clear_error(tmp_path):
    model = tiny_model(vocab_size=32)
    _lora(model, tmp_path, bad=True)
    with pytest.raises(ValueError, match="layer 1 lora_A"):
        load_draft_lora(model, str(tmp_path))


def test_device_map_auto_with_max_memory_loads_on_cpu(real_dir):
    model, _ = selfspec.load(real_dir, device_map="auto", max_memory={"cpu": "1GiB"}, dtype="float32")
    placed = set(getattr(model, "hf_device_map", {}).values()) | {p.device.type for p in model.parameters()}
    assert placed <= {"cpu"}
    ar, _ = generate_ids(model, [8, 9, 10], DecodeConfig(mode="ar", max_new_tokens=8), eos_token_id=[])
    assert len(ar) == 8


def test_a_device_map_that_cannot_fit_is_a_clear_error(real_dir):
    with pytest.raises(ValueError, match="max_memory allows"):
        selfspec.load(real_dir, device_map="auto", max_memory={"cpu": "10KB"})


def test_chat_template_on_a_tokenizer_without_one_is_a_clear_error(tiny_dir):
    _, tok = selfspec.load(tiny_dir)
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok, [{"role": "user", "content": "hi"}])


def test_upstream_entry_points_return_ids_with_prompt_and_nfe(real_dir):
    model, _ = selfspec.load(real_dir)
    prompt = torch.tensor([[8, 9, 10, 11]])
    ar, nfe_ar = model.ar_generate(prompt, max_new_tokens=16, eos_token_id=[])
    lin, nfe_lin = model.linear_spec_generate(prompt, max_new_tokens=16, block_length=4, eos_token_id=[])
    pre, nfe_pre = model.presto_spec_generate(prompt, max_new_tokens=16, block_length=4, eos_token_id=[])
    assert ar.shape == (1, 20) and torch.equal(ar[:, :4], prompt)
    assert torch.equal(ar, lin) and torch.equal(ar, pre)
    assert nfe_ar == 16 and nfe_lin >= 2 and nfe_pre >= 2
    with pytest.raises(ValueError, match="threshold"):
        model.linear_spec_generate(prompt, threshold=0.9)
    with pytest.raises(ValueError, match="mask_token_id"):
        model.linear_spec_generate(prompt, mask_token_id=5)
