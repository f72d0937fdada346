import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModel, Ministral3Config, Ministral3ForCausalLM

import selfspec  # noqa: F401  (registers the Auto classes)
import reference_cache as kv
from selfspec.engine.forward.masks import additive
from selfspec.checkpoint.model import NemotronLabsDiffusionModel

from conftest import tiny_config, tiny_model


def _ministral_twin(model):
    cfg = Ministral3Config(**{k: v for k, v in model.config.to_dict().items() if k in Ministral3Config.__dataclass_fields__})
    ref = Ministral3ForCausalLM(cfg).eval()
    sd = {k.replace("encoder.", "model.", 1).replace("diffusion_head", "lm_head"): v for k, v in model.state_dict().items()}
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert not [m for m in missing if "rotary" not in m] and not unexpected
    return ref


def test_causal_logits_match_ministral3_with_yarn_and_query_scaling(model):
    assert model.config.rope_parameters["original_max_position_embeddings"] == 8
    ref = _ministral_twin(model)
    ids = torch.randint(5, 64, (1, 40))
    pos = torch.arange(30, 70).unsqueeze(0)  # far past the original max: query scaling != 1
    ours = model(ids, position_ids=pos).logits
    theirs = ref(input_ids=ids, position_ids=pos).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_plain_call_is_causal_next_token_logits(model):
    ids = torch.randint(5, 64, (1, 12))
    full = model(ids).logits
    for t in (3, 7):
        prefix = model(ids[:, : t + 1]).logits
        assert torch.allclose(prefix[0, t], full[0, t], atol=1e-5)


def test_incremental_decoding_through_cache_equals_full_forward(model):
    ids = torch.randint(5, 64, (1, 16))
    full = model(ids).logits
    cache = kv.new_cache(model)
    out = [model(ids[:, :9], cache=cache).logits]
    for t in range(9, 16):
        out.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert kv.length(cache) == 16
    assert torch.allclose(torch.cat(out, 1), full, atol=1e-5)


def test_tree_mask_node_logits_equal_causal_path_logits(model):
    prefix = torch.randint(5, 64, (1, 6))
    # tree: 0 root; 1,2 children of 0; 3 child of 1; 4 child of 2; 5 child of 3
    parents = [-1, 0, 0, 1, 2, 3]
    tokens = torch.randint(5, 64, (1, 6))
    depth = [0, 1, 1, 2, 2, 3]
    anc = torch.zeros(6, 6, dtype=torch.bool)
    for v in range(6):
        u = v
        while u >= 0:
            anc[v, u] = True
            u = parents[u]
    allowed = torch.cat([torch.ones(6, 6, dtype=torch.bool), anc], 1)
    cache = kv.new_cache(model)
    model(prefix, cache=cache)
    pos = torch.tensor([[6 + d for d in depth]])
    logits = model(tokens, position_ids=pos, attention_mask=additive(allowed)[None, None], cache=cache).logits
    for v in range(6):
        path, u = [], v
        while u >= 0:
            path.insert(0, u)
            u = parents[u]
        seq = torch.cat([prefix, tokens[:, path]], 1)
        ref = model(seq).logits[0, -1]
        assert torch.allclose(logits[0, v], ref, atol=1e-5), v


def test_read_only_pass_leaves_cache_unchanged(model):
    ids = torch.randint(5, 64, (1, 10))
    cache = kv.new_cache(model)
    model(ids, cache=cache)
    before = [(l.keys.clone(), l.values.clone()) for l in cache.layers]
    with kv.read_only(cache):
        model(torch.randint(5, 64, (1, 5)), cache=cache, attention_mask=torch.zeros(1, 1, 5, 15))
        assert kv.length(cache) == 15
    assert kv.length(cache) == 10
    for (k, v), layer in zip(before, cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


def test_keep_positions_equals_recomputing_cache_on_kept_tokens(model):
    ids = torch.randint(5, 64, (1, 12))
    cache = kv.new_cache(model)
    model(ids[:, :8], cache=cache)
    # four new tokens forming a tree: 8 root, 9 and 10 children of 8, 11 child of 10
    parents = {8: None, 9: 8, 10: 8, 11: 10}
    allowed = torch.ones(4, 12, dtype=torch.bool)
    for q in range(8, 12):
        for k in range(8, 12):
            u, ok = q, False
            while u is not None:
                ok |= u == k
                u = parents[u]
            allowed[q - 8, k] = ok
    model(ids[:, 8:], position_ids=torch.tensor([[8, 9, 9, 10]]), attention_mask=additive(allowed)[None, None], cache=cache)
    kept = list(range(8)) + [8, 10, 11]
    kv.keep(cache, kept)
    fresh = kv.new_cache(model)
    model(ids[:, kept], cache=fresh)
    for a, b in zip(cache.layers, fresh.layers):
        assert torch.allclose(a.keys, b.keys, atol=1e-5) and torch.allclose(a.values, b.values, atol=1e-5)


def _write_sharded_bf16(model, path):
    os.makedirs(path, exist_ok=True)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    cfg = model.config.to_dict()
    cfg.update(torch_dtype="bfloat16", auto_map={
        "AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
        "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
        dlm_paradigm="bidirectional", some_training_only_key=0.5)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return sd


def test_sharded_bf16_checkpoint_loads_natively_and_through_automodel(model, tmp_path):
    sd = _write_sharded_bf16(model, tmp_path / "ckpt")
    for loader in (NemotronLabsDiffusionModel.from_pretrained, AutoModel.from_pretrained):
        m = loader(tmp_path / "ckpt", dtype=torch.bfloat16)
        assert isinstance(m, NemotronLabsDiffusionModel)
        assert m.dtype == torch.bfloat16
        for k, v in m.state_dict().items():
            assert torch.equal(v, sd[k]), k
        assert m.config.some_training_only_key == 0.5


def test_save_pretrained_round_trip(model, tmp_path):
    model.save_pretrained(tmp_path / "rt")
    again = NemotronLabsDiffusionModel.from_pretrained(tmp_path / "rt", dtype=torch.float32, device_map="cpu")
    ids = torch.randint(5, 64, (1, 9))
    assert torch.equal(again(ids).logits, model(ids).logits)
    assert again.config.mask_token_id == model.config.mask_token_id


@pytest.mark.parametrize(
    "breakage, match",
    [
        ("no_config", "no config.json"),
        ("model_type", "model_type"),
        ("missing_tensor", "encoder.layers.1.mlp.up_proj.weight"),
        ("bad_shape", "diffusion_head.weight"),
        ("mask_id", "mask_token_id"),
    ],
)
def test_bad_checkpoints_fail_with_a_named_error(model, tmp_path, breakage, match):
    path = tmp_path / "bad"
    sd = _write_sharded_bf16(model, path)
    cfg = json.loads((path / "config.json").read_text())
    if breakage == "no_config":
        os.remove(path / "config.json")
    elif breakage == "model_type":
        cfg["model_type"] = "llama"
    elif breakage == "mask_id":
        cfg["mask_token_id"] = cfg["vocab_size"] + 3
    elif breakage in ("missing_tensor", "bad_shape"):
        index = json.loads((path / "model.safetensors.index.json").read_text())
        key = "encoder.layers.1.mlp.up_proj.weight" if breakage == "missing_tensor" else "diffusion_head.weight"
        fname = index["weight_map"][key]
        keys = [k for k, f in index["weight_map"].items() if f == fname]
        shard = {k: sd[k] for k in keys}
        if breakage == "missing_tensor":
            del shard[key]
            del index["weight_map"][key]
        else:
            shard[key] = torch.zeros(3, 3, dtype=torch.bfloat16)
        save_file(shard, path / fname)
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    if breakage != "no_config":
        (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        NemotronLabsDiffusionModel.from_pretrained(path)


def test_config_rejects_mask_id_outside_vocab():
    with pytest.raises(ValueError, match="mask_token_id"):
        tiny_config(mask_token_id=64)


def test_inputs_beyond_max_positions_are_rejected(model):
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(5, 64, (1, 4)), position_ids=torch.tensor([[254, 255, 256, 257]]))


def test_commit_moves_only_the_accepted_tail_and_equals_keep(model):
    ids = torch.randint(5, 64, (1, 12))
    a, b = kv.new_cache(model), kv.new_cache(model)
    for c in (a, b):
        model(ids, cache=c)
    kv.commit(a, 7, [0, 2, 4])
    kv.keep(b, list(range(7)) + [7, 9, 11])
    for x, y in zip(a.layers, b.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
