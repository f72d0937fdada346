"""The vLLM plugin's pure parts; they run without vLLM installed."""
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from selfspec.serving import vllm as plugin
from selfspec.checkpoint.model import default_model_dir, expected_shapes

ROOT = Path(__file__).resolve().parent.parent


def test_every_tensor_of_the_shipped_checkpoint_maps_to_a_distinct_vllm_llama_name():
    with safe_open(str(Path(default_model_dir()) / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    mapped = [plugin.vllm_weight_name(n) for n in names]
    assert "lm_head.weight" in mapped and "model.embed_tokens.weight" in mapped
    kept = [m for m in mapped if m is not None]
    assert len(set(kept)) == len(kept)
    assert all(m == "lm_head.weight" or m.startswith("model.") for m in kept)


def test_the_untied_head_is_the_diffusion_head_not_the_embedding():
    pairs = dict(plugin.map_weights([("diffusion_head.weight", torch.ones(2)),
                                     ("encoder.embed_tokens.weight", torch.zeros(2))]))
    assert pairs["lm_head.weight"].sum() == 2 and pairs["model.embed_tokens.weight"].sum() == 0


def test_every_expected_tensor_name_is_mappable():
    raw = {"hidden_size": 8, "vocab_size": 16, "intermediate_size": 8, "num_attention_heads": 2,
           "num_key_value_heads": 1, "num_hidden_layers": 3}
    for name in expected_shapes(raw):
        assert plugin.vllm_weight_name(name) is not None, name


def test_rotary_buffers_are_dropped_because_vllm_recomputes_them():
    assert list(plugin.map_weights([("encoder.rotary_emb.inv_freq", torch.ones(2))])) == []


@pytest.mark.parametrize("name", ["encoder.layers.0.self_attn.q_norm.weight", "lm_head.weight",
                                  "model.layers.0.mlp.up_proj.weight", "encoder.layers.x.mlp.up_proj.weight",
                                  "diffusion_head.bias", "fc1.weight", "encoder.embed_tokens.weight.extra"])
def test_an_unknown_tensor_fails_the_load_naming_the_tensor(name):
    weights = plugin.map_weights([("encoder.norm.weight", torch.ones(2)), (name, torch.ones(2))])
    with pytest.raises(ValueError, match=re.escape(repr(name))):
        list(weights)


def test_llama_4_scaling_is_read_from_the_checkpoint_rope_parameters():
    from selfspec.checkpoint.config import NemotronLabsDiffusionConfig

    cfg = NemotronLabsDiffusionConfig.from_pretrained(default_model_dir())
    assert plugin.llama_4_scaling(cfg) == {"beta": 0.1, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize("v, ok", [("0.32.0", True), ("0.32.1", True), ("0.31.0", False), ("0.33.0", False)])
def test_vllm_outside_the_tested_range_is_refused_naming_the_range(v, ok):
    if ok:
        plugin.check_vllm(v)
    else:
        with pytest.raises(ImportError, match=re.escape(plugin.VLLM_RANGE)):
            plugin.check_vllm(v)


def test_the_plugin_is_declared_as_a_vllm_general_plugin_with_an_extra():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["entry-points"]["vllm.general_plugins"]["selfspec"] == "selfspec.serving.vllm:register"
    assert any(req.startswith("vllm") for req in meta["optional-dependencies"]["vllm"])
    assert plugin.VLLM_RANGE in " ".join(meta["optional-dependencies"]["vllm"])


def test_the_pure_module_does_not_import_vllm():
    src = (ROOT / "selfspec/serving/vllm.py").read_text()
    top = src.split("def register")[0]
    assert not re.search(r"^\s*(import vllm|from vllm)", top, re.M)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_register_makes_vllm_know_the_architecture():
    from vllm import ModelRegistry

    plugin.register()
    assert plugin.ARCHITECTURE in ModelRegistry.get_supported_archs()
