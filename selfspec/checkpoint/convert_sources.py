"""Readers for `selfspec.checkpoint.convert`: a llama.cpp GGUF file or a transformers Llama/Mistral directory.

Each source validates its whole header on construction (architecture, hyper-parameters, tensor
names, shapes, quantization types, sizes), so a bad input fails before anything is written, with
one error naming the file and the tensor or key. `tensors()` then yields (NLD name, float32
tensor) one at a time; `tokenizer()` builds the transformers tokenizer.

Like `convert`, it imports only from the checkpoint layer.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from selfspec.checkpoint.validate import read_config_json

# what a source's own generation_config.json says about sampling, carried into the conversion
SAMPLING_KEYS = ("do_sample", "temperature", "top_p", "top_k", "repetition_penalty", "no_repeat_ngram_size")

GGUF_ARCHS = ("llama",)  # llama.cpp writes Llama and Mistral models alike as "llama"
HF_MODEL_TYPES = ("llama", "mistral")
GGUF_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_TOP = {"token_embd": "encoder.embed_tokens", "output_norm": "encoder.norm", "output": "diffusion_head"}


def expected_shapes(hp: dict, *, head: bool) -> dict[str, tuple[int, ...]]:
    """NLD tensor name -> torch shape for the source's (unextended) vocabulary."""
    h, v, f, d = hp["hidden_size"], hp["vocab_size"], hp["intermediate_size"], hp["head_dim"]
    nq, nkv = hp["num_attention_heads"], hp["num_key_value_heads"]
    shapes = {"encoder.embed_tokens.weight": (v, h), "encoder.norm.weight": (h,)}
    if head:
        shapes["diffusion_head.weight"] = (v, h)
    for i in range(hp["num_hidden_layers"]):
        p = f"encoder.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (nq * d, h), p + "self_attn.k_proj.weight": (nkv * d, h),
            p + "self_attn.v_proj.weight": (nkv * d, h), p + "self_attn.o_proj.weight": (h, nq * d),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        })
    return shapes


def _check_shapes(path: str, found: dict[str, tuple], hp: dict, head: bool) -> None:
    want = expected_shapes(hp, head=head)
    extra = sorted(set(found) - set(want))
    if extra:
        raise ValueError(f"{path}: tensor {extra[0]!r} has no counterpart in a Llama model of this size")
    for name, shape in want.items():
        if name not in found:
            raise ValueError(f"{path}: tensor {name!r} is missing")
        if tuple(found[name]) != shape:
            raise ValueError(f"{path}: tensor {name!r} has shape {tuple(found[name])}, expected {shape}")


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permute (rows [head, 2, d/2] stored as [head, d/2, 2]), as transformers does."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """A llama-architecture GGUF file."""

    def __init__(self, path: str):
        from gguf import GGUFReader

        self.path = path
        try:
            self.reader = GGUFReader(path)
            tensors = list(self.reader.tensors)
        except Exception as e:  # gguf raises ValueError, struct / numpy errors, IndexError... on a bad file
            raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt): "
                             f"{type(e).__name__}: {e}") from None
        arch = self._get("general.architecture")
        if arch not in GGUF_ARCHS:
            raise ValueError(f"{path}: general.architecture is {arch!r}; only Llama-architecture GGUF files "
                             f"({', '.join(GGUF_ARCHS)}) can be converted")
        self.arch = arch
        for t in tensors:
            if int(t.data.nbytes) != int(t.n_bytes):
                raise ValueError(f"{path} is truncated: tensor {t.name!r} has {t.data.nbytes} of its {t.n_bytes} bytes")
        self.by_name = {t.name: t for t in tensors}
        self.names = {}
        for t in tensors:
            self.names[t.name] = self._nld_name(t.name)
            _check_quant(path, t)
        emb = self.by_name.get("token_embd.weight")
        if emb is None:
            raise ValueError(f"{path}: tensor 'token_embd.weight' is missing")
        self.hparams = hp = self._hparams(int(emb.shape[-1]))
        self.generation = {}  # a GGUF holds no sampling settings
        found = {self.names[t.name]: tuple(int(x) for x in reversed(t.shape.tolist())) for t in tensors}
        _check_shapes(path, found, hp, head="output.weight" in self.by_name)

    def _get(self, key: str, default=None, *, required: bool = False):
        field = self.reader.fields.get(key)
        if field is None:
            if required:
                raise ValueError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def _nld_name(self, name: str) -> str:
        parts = name.split(".")
        if len(parts) == 2 and parts[0] in GGUF_TOP and parts[1] == "weight":
            return GGUF_TOP[parts[0]] + ".weight"
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in GGUF_LAYER and parts[3] == "weight":
            return f"encoder.layers.{int(parts[1])}.{GGUF_LAYER[parts[2]]}.weight"
        if name == "rope_freqs.weight":
            raise ValueError(f"{self.path}: tensor 'rope_freqs.weight' (Llama-3 rope scaling) is not supported")
        raise ValueError(f"{self.path}: tensor {name!r} has no counterpart in a Llama model (biases, experts "
                         f"and extra tensors are not supported)")

    def _hparams(self, vocab: int) -> dict:
        a = self.arch
        hidden = int(self._get(f"{a}.embedding_length", required=True))
        heads = int(self._get(f"{a}.attention.head_count", required=True))
        kv = int(self._get(f"{a}.attention.head_count_kv", heads))
        rope_dim = self._get(f"{a}.rope.dimension_count")
        head_dim = int(self._get(f"{a}.attention.key_length", rope_dim or hidden // heads))
        for key, value in ((f"{a}.rope.dimension_count", rope_dim),
                           (f"{a}.attention.value_length", self._get(f"{a}.attention.value_length"))):
            if value is not None and int(value) != head_dim:
                raise ValueError(f"{self.path}: {key} = {value} differs from the head size {head_dim} (not supported)")
        scaling = self._get(f"{a}.rope.scaling.type")
        if scaling not in (None, "none") or float(self._get(f"{a}.rope.scaling.factor", 1.0) or 1.0) != 1.0:
            raise ValueError(f"{self.path}: rope scaling {scaling!r} is not supported (plain RoPE only)")
        if int(self._get(f"{a}.expert_count", 0) or 0) > 0:
            raise ValueError(f"{self.path}: mixture-of-experts models are not supported")
        return {
            "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "intermediate_size": int(self._get(f"{a}.feed_forward_length", required=True)),
            "num_hidden_layers": int(self._get(f"{a}.block_count", required=True)),
            "rms_norm_eps": float(self._get(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(self._get(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._get(f"{a}.context_length", required=True)),
            "vocab_size": vocab,
            "bos_token_id": _opt_int(self._get("tokenizer.ggml.bos_token_id")),
            "eos_token_id": _opt_int(self._get("tokenizer.ggml.eos_token_id")),
            "pad_token_id": _opt_int(self._get("tokenizer.ggml.padding_token_id")),
        }

    def tensor_names(self) -> list[str]:
        return list(self.names.values())

    def tensors(self):
        from gguf.quants import dequantize

        hp = self.hparams
        for gname, t in self.by_name.items():
            name = self.names[gname]
            try:
                w = dequantize(t.data, t.tensor_type)
            except Exception as e:
                raise ValueError(f"{self.path}: cannot dequantize tensor {gname!r} "
                                 f"({t.tensor_type.name}): {e}") from None
            w = np.asarray(w, dtype=np.float32).reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
            if name.endswith("self_attn.q_proj.weight"):
                w = unpermute_rotary(w, hp["num_attention_heads"])
            elif name.endswith("self_attn.k_proj.weight"):
                w = unpermute_rotary(w, hp["num_key_value_heads"])
            yield name, torch.from_numpy(np.array(w, dtype=np.float32, copy=True))

    def tokenizer(self):
        from transformers import AutoTokenizer

        folder, fname = os.path.split(os.path.abspath(self.path))
        try:
            return AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
        except Exception as e:
            raise ValueError(f"{self.path}: cannot build a tokenizer from the GGUF metadata: {e}") from None


_SUPPORTED: dict = {}


def _check_quant(path: str, t) -> None:
    """One clear error for a quantization type `gguf.quants.dequantize` does not handle."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    qtype = t.tensor_type
    if qtype not in _SUPPORTED:
        block, nbytes = GGML_QUANT_SIZES.get(qtype, (1, 0))
        try:
            dequantize(np.zeros((1, nbytes), dtype=np.uint8), qtype)
            _SUPPORTED[qtype] = nbytes > 0
        except Exception:
            _SUPPORTED[qtype] = False
    if not _SUPPORTED[qtype]:
        raise ValueError(f"{path}: tensor {t.name!r} has quantization type {qtype.name}, which gguf "
                         f"cannot dequantize (F32, F16, BF16, Q4_0..Q8_0, K- and IQ-quants are supported)")


def _opt_int(v):
    return None if v is None else int(v)


class HFSource:
    """A transformers Llama / Mistral checkpoint directory (config.json + safetensors); no permute needed."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        cfg_path, cfg = read_config_json(path, "transformers checkpoint")
        if cfg.get("model_type") not in HF_MODEL_TYPES:
            raise ValueError(f"{cfg_path}: model_type is {cfg.get('model_type')!r}; expected one of {HF_MODEL_TYPES}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"{cfg_path}: rope type {rope.get('rope_type', rope.get('type'))!r} is not supported "
                             "(plain RoPE only)")
        for key, bad in (("attention_bias", True), ("mlp_bias", True)):
            if cfg.get(key) == bad:
                raise ValueError(f"{cfg_path}: {key} = true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg_path}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if cfg.get("sliding_window") is not None and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0):
            raise ValueError(f"{cfg_path}: sliding-window attention is not supported")
        gen = {}
        if os.path.isfile(os.path.join(path, "generation_config.json")):
            with open(os.path.join(path, "generation_config.json")) as f:
                gen = json.load(f)
        self.generation = {k: gen[k] for k in SAMPLING_KEYS if k in gen}  # carried into the conversion
        heads = cfg["num_attention_heads"]
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.hparams = {
            "hidden_size": cfg["hidden_size"], "num_attention_heads": heads,
            "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
            "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": cfg["num_hidden_layers"],
            "rms_norm_eps": cfg.get("rms_norm_eps", 1e-6),
            "rope_theta": float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            "max_position_embeddings": cfg["max_position_embeddings"], "vocab_size": cfg["vocab_size"],
            "bos_token_id": gen.get("bos_token_id", cfg.get("bos_token_id")),
            "eos_token_id": gen.get("eos_token_id", cfg.get("eos_token_id")),
            "pad_token_id": gen.get("pad_token_id", cfg.get("pad_token_id")),
        }
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(path, "model.safetensors")):
            files = ["model.safetensors"]
        else:
            raise FileNotFoundError(f"{path} has no model.safetensors (or index); "
                                    "other weight formats are not supported")
        self.files = {}
        found = {}
        for fname in files:
            fp = os.path.join(path, fname)
            if not os.path.isfile(fp):
                raise FileNotFoundError(f"{fp} is listed in the index but missing")
            try:
                with safe_open(fp, framework="pt") as sf:
                    for key in sf.keys():
                        name = self._nld_name(key)
                        if name is not None:
                            self.files[key] = (fp, name)
                            found[name] = tuple(sf.get_slice(key).get_shape())
            except ValueError:
                raise
            except Exception as e:
                raise ValueError(f"{fp} is not a readable safetensors file: {e}") from None
        _check_shapes(path, found, self.hparams, head=not self.tied)

    def _nld_name(self, key: str) -> str | None:
        if "rotary_emb" in key:
            return None
        if key == "lm_head.weight":
            return None if self.tied else "diffusion_head.weight"
        if key.startswith("model.") and (key in ("model.embed_tokens.weight", "model.norm.weight")
                                         or key.startswith("model.layers.")):
            return "encoder." + key[len("model."):]
        raise ValueError(f"{self.path}: tensor {key!r} has no counterpart in a Llama model")

    def tensor_names(self) -> list[str]:
        return [name for _, name in self.files.values()]

    def tensors(self):
        from safetensors import safe_open

        for fp in dict.fromkeys(fp for fp, _ in self.files.values()):
            with safe_open(fp, framework="pt") as sf:
                for key, (kfp, name) in self.files.items():
                    if kfp == fp:
                        yield name, sf.get_tensor(key).float()

    def tokenizer(self):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        except Exception as e:
            raise ValueError(f"{self.path}: cannot load its tokenizer: {e}") from None
