"""GGUF (and HF Llama directory) -> NLD checkpoint conversion (selfspec.checkpoint.convert).

A tiny Llama GGUF is written here with gguf's own writer, the way llama.cpp writes one (Q/K rows
permuted into the interleaved rotary layout, F32 / F16 / Q8_0 / Q4_1 tensors, a byte-level BPE
vocabulary with merges and a chat template). transformers' `LlamaForCausalLM` loaded from that
same file is the reference: the converted model's causal logits must match it on the original
vocabulary, and its tokenizer must give the GGUF tokenizer's ids.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest
import torch

import selfspec
from selfspec.checkpoint import convert as conv

H, NH, NKV, D, F, L, CTX = 64, 4, 2, 16, 128, 2, 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["def", "Ġfib", "Ġfibonacci", "return", "Ġreturn", "Ġthe", "Ġin", "ing", "Ġ=", "ĠĠĠ", "ĠĠĠĠ", "self",
         "Ġprint", "(n", "):", "ĊĠĠĠ", "Ġif", "Ġelse", "user", "Ġhello", "assistant", "system", "Ġworld"]
CHAT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["def fibonacci(n):\n    return n", "hello world, the end!", "  ünïcödé  \t\n x=1", "<|im_start|>user\nhi"]


def _qt():
    import gguf

    return gguf.GGMLQuantizationType


def vocab():
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = SPECIALS + list(bytes_to_unicode().values())
    merges = []
    for word in WORDS:
        cur = word[0]
        for ch in word[1:]:
            if cur + ch not in tokens:
                merges.append(f"{cur} {ch}")
                tokens.append(cur + ch)
            cur += ch
    return tokens, merges


def llama_weights(n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights in transformers' layout, scaled so logits are well spread (no greedy near-ties)."""
    rng = np.random.default_rng(seed)

    def lin(o, i):
        return (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)

    w = {"token_embd": rng.standard_normal((n_vocab, H)).astype(np.float32),
         "output": 2 * lin(n_vocab, H), "output_norm": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)}
    for i in range(L):
        w.update({f"blk.{i}.attn_q": 2 * lin(NH * D, H), f"blk.{i}.attn_k": 2 * lin(NKV * D, H),
                  f"blk.{i}.attn_v": lin(NKV * D, H), f"blk.{i}.attn_output": lin(H, NH * D),
                  f"blk.{i}.ffn_gate": lin(F, H), f"blk.{i}.ffn_up": lin(F, H), f"blk.{i}.ffn_down": lin(H, F),
                  f"blk.{i}.attn_norm": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32),
                  f"blk.{i}.ffn_norm": (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)})
    return w


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF -> GGUF row order of Q and K)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qtypes():
    q = _qt()
    types = {"token_embd": q.Q8_0, "output": q.Q4_1}
    for i in range(L):
        types.update({f"blk.{i}.attn_q": q.Q4_1 if i == 0 else q.F32, f"blk.{i}.attn_k": q.Q8_0 if i == 0 else q.F32,
                      f"blk.{i}.attn_v": q.F32, f"blk.{i}.attn_output": q.Q4_1, f"blk.{i}.ffn_gate": q.Q8_0,
                      f"blk.{i}.ffn_up": q.Q4_1, f"blk.{i}.ffn_down": q.F16})
    return types


def write_gguf(path, *, arch="llama", tied=False, types=None, seed=0):
    """A llama.cpp-style GGUF of a tiny Llama; returns the HF-layout weights it was made from."""
    import gguf

    tokens, merges = vocab()
    w = llama_weights(len(tokens), seed)
    if tied:
        del w["output"]
    types = {**qtypes(), **(types or {})}
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name("tiny-llama")
    wr.add_context_length(CTX)
    wr.add_embedding_length(H)
    wr.add_block_count(L)
    wr.add_feed_forward_length(F)
    wr.add_head_count(NH)
    wr.add_head_count_kv(NKV)
    wr.add_rope_dimension_count(D)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_vocab_size(len(tokens))
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("smollm")
    wr.add_token_list(tokens)
    wr.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    wr.add_token_merges(merges)
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_pad_token_id(2)
    wr.add_unk_token_id(0)
    wr.add_add_bos_token(False)
    wr.add_chat_template(CHAT)
    for name, a in w.items():
        if name.endswith("attn_q"):
            a = permute(a, NH)
        elif name.endswith("attn_k"):
            a = permute(a, NKV)
        qt = types.get(name, _qt().F32)
        if qt == _qt().F32:
            wr.add_tensor(name + ".weight", a)
        elif qt == _qt().F16:
            wr.add_tensor(name + ".weight", a.astype(np.float16))
        elif qt == _qt().Q8_1:  # gguf cannot (de)quantize it: raw zero blocks of the right size
            block, nbytes = gguf.GGML_QUANT_SIZES[qt]
            wr.add_tensor(name + ".weight", np.zeros((a.shape[0], a.shape[1] // block * nbytes), np.uint8), raw_dtype=qt)
        else:
            wr.add_tensor(name + ".weight", gguf.quants.quantize(a, qt), raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return w


def llama_from_gguf(path):
    from transformers import LlamaForCausalLM

    folder, name = os.path.split(str(path))
    return LlamaForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def greedy(model, ids, n):
    ids = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], 1)
    return ids[0].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    src = d / "tiny.gguf"
    weights = write_gguf(src)
    out = conv.convert(src, d / "nld", progress=False)
    return {"src": src, "out": out, "weights": weights, "ref": llama_from_gguf(src)}


def test_causal_logits_and_greedy_equal_llama_from_the_same_gguf(tiny):
    model, tok = selfspec.load(tiny["out"])
    ref = tiny["ref"]
    v = ref.config.vocab_size
    assert model.config.vocab_size == v + 1 and model.config.mask_token_id == v
    assert model.encoder.rotary_emb.attention_scaling == 1.0
    assert torch.equal(model.encoder.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq)
    gen = torch.Generator().manual_seed(0)
    for ids in [tok(TEXTS[0]).input_ids, torch.randint(0, v, (40,), generator=gen).tolist()]:
        x = torch.tensor([ids])
        with torch.no_grad():
            ours, theirs = model(x).logits, ref(x).logits
        assert ours.shape[-1] == v + 1
        diff = (ours[..., :v] - theirs).abs().max().item()
        assert diff < 1e-4, diff
        assert theirs.std() > 1.0  # a real check: logits are far from flat
        assert greedy(model, ids, 12) == greedy(ref, ids, 12)


def test_weights_unpermuted_and_mask_rows(tiny):
    from safetensors.torch import load_file

    sd = load_file(os.path.join(tiny["out"], "model.safetensors"))
    w = tiny["weights"]
    # layer 1's Q and K are F32 in the file: exact round trip through llama.cpp's permute
    assert torch.equal(sd["encoder.layers.1.self_attn.q_proj.weight"], torch.from_numpy(w["blk.1.attn_q"]))
    assert torch.equal(sd["encoder.layers.1.self_attn.k_proj.weight"], torch.from_numpy(w["blk.1.attn_k"]))
    assert torch.equal(sd["encoder.layers.0.self_attn.v_proj.weight"], torch.from_numpy(w["blk.0.attn_v"]))
    emb, head = sd["encoder.embed_tokens.weight"], sd["diffusion_head.weight"]
    torch.testing.assert_close(emb[-1], emb[:-1].mean(0))
    torch.testing.assert_close(head[-1], head[:-1].mean(0))
    assert not torch.equal(emb, head)  # untied source: the head is the file's output.weight


def test_config_generation_config_and_tokenizer(tiny):
    from transformers import AutoTokenizer, GenerationConfig

    out = tiny["out"]
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    v = len(vocab()[0])
    assert cfg["model_type"] == "nemotron_labs_diffusion" and cfg["architectures"] == ["NemotronLabsDiffusionModel"]
    assert (cfg["vocab_size"], cfg["mask_token_id"], cfg["tie_word_embeddings"]) == (v + 1, v, False)
    rope = cfg["rope_parameters"]
    assert (rope["factor"], rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]) == (1.0, 0.0, CTX)
    gc = GenerationConfig.from_pretrained(out)
    assert gc.suppress_tokens == [v] and (gc.bos_token_id, gc.eos_token_id) == (1, 2)

    tok = AutoTokenizer.from_pretrained(out)
    folder, name = os.path.split(str(tiny["src"]))
    ref = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for text in TEXTS:
        assert tok(text).input_ids == ref(text).input_ids, text
    assert tok.chat_template == CHAT
    msgs = [{"role": "user", "content": "hello world"}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.mask_token == conv.MASK_TOKEN and tok.convert_tokens_to_ids(conv.MASK_TOKEN) == v
    assert tok.decode([5, v, 6], skip_special_tokens=True) == ref.decode([5, 6])
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_tied_gguf_head_is_the_embedding(tmp_path):
    write_gguf(tmp_path / "t.gguf", tied=True)
    out = conv.convert(tmp_path / "t.gguf", tmp_path / "nld", progress=False)
    from safetensors.torch import load_file

    sd = load_file(os.path.join(out, "model.safetensors"))
    assert torch.equal(sd["encoder.embed_tokens.weight"], sd["diffusion_head.weight"])
    ref = llama_from_gguf(tmp_path / "t.gguf")
    model = selfspec.NemotronLabsDiffusionModel.from_pretrained(out)
    x = torch.tensor([[3, 50, 100, 200, 7, 9]])
    with torch.no_grad():
        assert (model(x).logits[..., :-1] - ref(x).logits).abs().max() < 1e-4


def test_sharded_output_loads(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(conv, "SHARD_BYTES", 60_000)
    out = conv.convert(tiny["src"], tmp_path / "nld", progress=False)
    assert len(glob.glob(os.path.join(out, "model-*-of-*.safetensors"))) > 2
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    model = selfspec.NemotronLabsDiffusionModel.from_pretrained(out)
    x = torch.tensor([[3, 50, 100, 200, 7, 9]])
    with torch.no_grad():
        assert (model(x).logits[..., :-1] - tiny["ref"](x).logits).abs().max() < 1e-4


def test_interrupted_conversion_leaves_nothing(tiny, tmp_path, monkeypatch):
    real = conv._write_json

    def boom(path, obj):  # weights and tokenizer are on disk by now; config.json is not
        assert os.path.isfile(os.path.join(os.path.dirname(path), "model.safetensors"))
        raise KeyboardInterrupt

    monkeypatch.setattr(conv, "_write_json", boom)
    out = tmp_path / "nld"
    with pytest.raises(KeyboardInterrupt):
        conv.convert(tiny["src"], out, progress=False)
    assert not out.exists() and not glob.glob(f"{out}.tmp-*")
    monkeypatch.setattr(conv, "_write_json", real)
    assert conv.convert(tiny["src"], out, progress=False) == str(out)
    assert sorted(os.listdir(out)) == sorted(os.listdir(tiny["out"]))
    with pytest.raises(FileExistsError, match="not empty"):
        conv.convert(tiny["src"], out, progress=False)


def test_bad_inputs_each_one_clear_error(tiny, tmp_path):
    import gguf

    out = tmp_path / "out"
    wr = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    wr.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf: general\.architecture is 'gpt2'"):
        conv.convert(tmp_path / "gpt2.gguf", out)

    data = open(tiny["src"], "rb").read()
    for cut in (10, 2000, len(data) // 2, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"cut\.gguf .*(truncated|corrupt)"):
            conv.convert(tmp_path / "cut.gguf", out)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=r"junk\.gguf is not a readable GGUF file"):
        conv.convert(tmp_path / "junk.gguf", out)

    write_gguf(tmp_path / "q81.gguf", types={"blk.1.ffn_up": _qt().Q8_1})
    with pytest.raises(ValueError, match=r"q81\.gguf: tensor 'blk\.1\.ffn_up\.weight' has quantization type Q8_1"):
        conv.convert(tmp_path / "q81.gguf", out)

    with pytest.raises(FileNotFoundError, match="nope.gguf does not exist"):
        conv.convert(tmp_path / "nope.gguf", out)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OSError, match=r"cannot write the output folder .*afile/out"):
        conv.convert(tiny["src"], tmp_path / "afile" / "out")
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        with pytest.raises(PermissionError, match="cannot write the output folder"):
            conv.convert(tiny["src"], ro / "out")
    assert not out.exists() and not glob.glob(str(tmp_path / "*.tmp-*"))


def test_cli_main_bfloat16(tiny, tmp_path, capsys):
    out = tmp_path / "bf16"
    assert conv.main([str(tiny["src"]), str(out), "--dtype", "bfloat16", "--quiet"]) == 0
    model = selfspec.NemotronLabsDiffusionModel.from_pretrained(str(out), dtype=torch.bfloat16)
    assert model.encoder.embed_tokens.weight.dtype == torch.bfloat16
    assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"
    assert conv.main([str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 2
    assert "missing.gguf does not exist" in capsys.readouterr().err


def test_hf_llama_directory(tiny, tmp_path):
    """A transformers Llama directory converts too (no permute there): same logits."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    ref = tiny["ref"]
    cfg = LlamaConfig(vocab_size=ref.config.vocab_size, hidden_size=H, intermediate_size=F, num_hidden_layers=L,
                      num_attention_heads=NH, num_key_value_heads=NKV, head_dim=D, max_position_embeddings=CTX,
                      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    hf = LlamaForCausalLM(cfg)
    hf.load_state_dict(ref.state_dict())
    hf.save_pretrained(tmp_path / "hf")
    folder, name = os.path.split(str(tiny["src"]))

    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp_path / "hf")
    out = conv.convert(tmp_path / "hf", tmp_path / "nld", progress=False)
    model = selfspec.NemotronLabsDiffusionModel.from_pretrained(out)
    x = torch.tensor([[3, 50, 100, 200, 7, 9]])
    with torch.no_grad():
        assert (model(x).logits[..., :-1] - ref(x).logits).abs().max() < 1e-4


# -- the real file -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    try:
        src = conv.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    out = conv.convert(src, tmp_path_factory.mktemp("smollm2") / "nld", progress=False)
    return src, out


def test_smollm2_greedy_equals_llama_from_gguf(smollm2):
    src, out = smollm2
    model, tok = selfspec.load(out)
    ref = llama_from_gguf(src)
    ids = tok.apply_chat_template([{"role": "user", "content": "Write a Python function that reverses a string"}],
                                  add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    x = torch.tensor([ids])
    with torch.no_grad():
        assert (model(x).logits[..., :-1] - ref(x).logits).abs().max() < 1e-4
    assert greedy(model, ids, 8) == greedy(ref, ids, 8)
