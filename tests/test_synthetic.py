"""Synthetic models (`selfspec.checkpoint.synthetic`): the published shapes, built layer by layer in
the requested format within a memory bound, and refused by chat."""

import json
import os
import subprocess
import sys

import pytest
import torch

import selfspec
from selfspec.checkpoint import synthetic
from selfspec.checkpoint.model import expected_shapes
from selfspec.checkpoint.quant import FORMATS, quantize
from selfspec.engine.forward.forward import FastForward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def test_shapes_match_the_published_checkpoint_size():
    # the 8B's bf16 checkpoint is 15.95 GiB (spec), its draft LoRA 34 x 128 x (4096 + 4096) weights beside it
    cfg = synthetic.SHAPES["nld-8b"]
    weights = sum(torch.Size(s).numel() for s in expected_shapes(cfg).values())
    lora = 34 * 128 * (4096 + 4096)
    assert abs(2 * (weights + lora) / GIB - 15.95) / 15.95 < 0.01
    assert synthetic.weight_bytes("nld-8b") < 2 * weights  # the embedding is a lookup, not read whole


def _resident_bytes(model) -> int:
    """Bytes the model holds: its parameters' storages (a placeholder's is 2 bytes) and packed weights."""
    seen, total = set(), 0
    tensors = [p for p in model.parameters()]
    fmt = model.__dict__.get("selfspec_weights")
    for w in (fmt.weights.values() if fmt else ()):
        tensors += [v for v in vars(w).values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


@pytest.mark.parametrize("weights", ["bf16", "int8", "int4", "w4a8"])
def test_built_in_its_format_without_an_fp32_copy(weights):
    model, tok = selfspec.load("synthetic:tiny", weights=weights, progress=False)
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())  # what a whole fp32 copy holds
    assert _resident_bytes(model) < 0.6 * fp32_bytes
    ff = FastForward.of(model)
    assert ff.weights == weights and ff.exact
    if weights != "bf16":  # the transformers modules hold placeholders: their forward refuses
        with pytest.raises(RuntimeError, match="packed"):
            model(torch.tensor([[300, 301]]))


def test_peak_memory_of_a_build_stays_below_an_fp32_copy():
    # a 130M-weight shape (520 MB in fp32) in a fresh process: the build's peak RSS growth stays
    # under 60% of the fp32 bytes, which a build that made the whole matrix (or model) first exceeds
    code = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
import torch
torch.set_num_threads(1)  # one malloc arena's worth of temporaries: the build's pattern, not the threads'
from selfspec.checkpoint import synthetic
synthetic.SHAPES["mid"] = dict(synthetic.SHAPES["tiny"], hidden_size=1024, intermediate_size=4096,
                               num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                               vocab_size=32768)
synthetic.LORA["mid"] = (16, 64.0)
synthetic.CHUNK_ELEMS = 1 << 21
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
before = rss()
model, tok, packed = synthetic.build("synthetic:mid", fmt="int8", progress=False)
# VmHWM is this image's own high-water mark; ru_maxrss also keeps the forking parent's RSS from exec
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
n = sum(p.numel() for p in model.parameters())
print(json.dumps({"growth": peak - before, "fp32": 4 * n}))
"""
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, ROOT], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["fp32"] > 500e6
    assert r["growth"] < 0.6 * r["fp32"], r


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("head", [False, True])
def test_chunked_quantization_is_the_whole_matrix_s(fmt, head):
    w = torch.randn(336, 128, generator=torch.Generator().manual_seed(1))
    whole = quantize(w, fmt, head=head)
    chunked = synthetic.quantize_chunked(lambda a, b: w[a:b], tuple(w.shape), fmt, head=head, chunk_elems=64 * 128)
    assert type(chunked) is type(whole)
    if isinstance(whole, torch.Tensor):
        assert torch.equal(chunked, whole)
        return
    for k, v in vars(whole).items():
        got = getattr(chunked, k)
        assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v, k
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(chunked(x), whole(x))


def test_seeded_and_the_draft_lora_attached():
    a, _, pa = synthetic.build("synthetic:tiny", fmt="int8", progress=False)
    b, _, pb = synthetic.build("synthetic:tiny", fmt="int8", progress=False)
    key = "encoder.layers.1.gate_up"
    assert torch.equal(pa[key].q, pb[key].q) and torch.equal(a.encoder.embed_tokens.weight, b.encoder.embed_tokens.weight)
    c, _, pc = synthetic.build("synthetic:tiny", fmt="int8", seed=1, progress=False)
    assert not torch.equal(pa[key].q, pc[key].q)
    assert a.draft_lora is not None and a.draft_lora.targets == ("o_proj",)
    none, _, _ = synthetic.build("synthetic:tiny", fmt="int8", draft_lora=False, progress=False)
    assert getattr(none, "draft_lora", None) is None


def test_speculation_runs_and_equals_ar():
    model, tok = selfspec.load("synthetic:tiny", weights="w4a8", progress=False)
    kw = dict(max_new_tokens=12, eos_token_id=[])
    ar = selfspec.generate(model, tok, "def f(x):", mode="ar", **kw)
    for mode in ("linear", "presto"):
        assert selfspec.generate(model, tok, "def f(x):", mode=mode, **kw).token_ids == ar.token_ids
    assert len(ar.token_ids) == 12


def test_tokenizer_is_byte_level_and_labels_other_ids():
    cfg = synthetic.config("synthetic:tiny")
    tok = synthetic.SyntheticTokenizer(cfg, "synthetic:tiny")
    ids = tok.encode("héllo\n")
    assert all(synthetic.BYTE_BASE <= i < synthetic.BYTE_BASE + 256 for i in ids) and cfg.mask_token_id not in ids
    assert tok.decode(ids) == "héllo\n"
    assert tok.decode([1000, ids[0], cfg.eos_token_id]) == "<1000>h"
    assert tok.decode([cfg.eos_token_id], skip_special_tokens=False) == f"<{cfg.eos_token_id}>"


def test_chat_and_auto_refuse_it_before_building():
    from selfspec.tools.chat import run_chat

    model, tok = selfspec.load("synthetic:tiny", weights="int8", progress=False)
    with pytest.raises(ValueError, match="synthetic model .* chat"):
        selfspec.generate(model, tok, [{"role": "user", "content": "hi"}], max_new_tokens=4)
    with pytest.raises(ValueError, match="synthetic model"):
        run_chat(model, tok)
    with pytest.raises(ValueError, match="random weights.*auto"):
        selfspec.load("synthetic:tiny", weights="auto")
    with pytest.raises(ValueError, match="unknown synthetic model"):
        selfspec.load("synthetic:nld-1b", weights="int8")
    for argv in (["chat", "--model", "synthetic:nld-8b"], ["generate", "--model", "synthetic:nld-8b", "--chat", "hi"]):
        out = subprocess.run([sys.executable, "-m", "selfspec", *argv], capture_output=True, text=True, timeout=300,
                             cwd=ROOT)
        assert out.returncode == 2 and "synthetic model" in out.stderr and "building" not in out.stderr


def test_fp32_is_the_packed_formats_source():
    # every format draws the same fp32 numbers: int8 of the fp32 build's fused weights is the int8 build's
    f, _, _ = synthetic.build("synthetic:tiny", fmt="fp32", progress=False)
    _, _, packed = synthetic.build("synthetic:tiny", fmt="int8", progress=False)
    mlp = f.encoder.layers[1].mlp
    gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
    assert torch.equal(quantize(gate_up, "int8").q, packed["encoder.layers.1.gate_up"].q)
    assert torch.equal(quantize(f.diffusion_head.weight, "int8").q, packed["diffusion_head.weight"].q)


def test_bench_on_a_synthetic_model_takes_the_shipped_plain_prompts(tmp_path, capsys):
    """`bench --model synthetic:nld-3b` needs no --prompts: the shipped model's prompts, chat ones
    dropped with one line (a synthetic tokenizer has no chat template); a file of chats only is
    refused before any model work; a real model keeps its chats."""
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.tools.bench_prompts import bench_prompts

    path, rows = bench_prompts(None, "synthetic:nld-3b")
    assert path == os.path.join(default_model_dir(), "prompts.jsonl") and rows
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"prompt": "def f():"}) + "\n" + chat + "\n")
    capsys.readouterr()
    assert [r["prompt"] for r in bench_prompts(str(mixed), "synthetic:nld-3b")[1]] == ["def f():"]
    assert "1 chat prompts" in capsys.readouterr().err
    assert len(bench_prompts(str(mixed), str(tmp_path))[1]) == 2
    chats = tmp_path / "chats.jsonl"
    chats.write_text(chat + "\n")
    with pytest.raises(ValueError, match="plain-text"):
        bench_prompts(str(chats), "synthetic:nld-3b")
