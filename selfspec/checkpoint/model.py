"""`NemotronLabsDiffusionModel`: the Ministral-3 backbone under `encoder.` plus `diffusion_head`.

One set of weights, two readings. With a causal mask the logits at position i predict token
i+1 (AR, verification); with mask tokens attending bidirectionally inside a block the logits at
position i are the marginal of the token *at* i (drafting). Which reading applies is decided
only by the float additive 4-D mask and the explicit position ids the caller passes, so the
runtime owns attention completely; the backbone is transformers' own `Ministral3Model`,
unmodified.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, Ministral3Model, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.utils import ModelOutput

from selfspec.checkpoint.config import NemotronLabsDiffusionConfig
from selfspec.checkpoint.registry import resolve
from selfspec.checkpoint.validate import check_device, check_safetensors_files, read_config_json
from selfspec.checkpoint.versions import cache_argument

# read once: 5.23 and older take `past_key_values` and silently ignore `cache` (selfspec.checkpoint.versions)
CACHE_ARG = cache_argument(Ministral3Model.forward)


@dataclass
class DiffusionLMOutput(ModelOutput):
    logits: torch.Tensor | None = None
    cache: Cache | None = None
    hidden_states: torch.Tensor | None = None


class NemotronLabsDiffusionModel(PreTrainedModel):
    config_class = NemotronLabsDiffusionConfig
    base_model_prefix = "encoder"
    _no_split_modules = ["Ministral3DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # tree masks are arbitrary 4-D tensors
    _supports_flex_attn = False  # transformers' flex path crashes on 4-D tensor masks (docs/model.md)
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    def __init__(self, config: NemotronLabsDiffusionConfig):
        super().__init__(config)
        self.encoder = Ministral3Model(config)
        self.diffusion_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def __setattr__(self, name, value):
        if name == "presto_predictor":
            # PRESTO's learned-rho MLP rides along as a plain attribute, not a submodule: it scores
            # fp32 features on the CPU whatever the forward's format or device, so `model.to(bf16)`
            # (weights bf16 / int8 / int4) or `.to("cuda")` must not convert it, and its weights are
            # not the model's (they live in presto_predictor.safetensors, not in state_dict())
            self._modules.pop(name, None)
            object.__setattr__(self, name, value)
            return
        super().__setattr__(name, value)

    def get_input_embeddings(self):
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value):
        self.encoder.embed_tokens = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        *,
        position_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        output_hidden_states: bool = False,
        **kwargs,
    ) -> DiffusionLMOutput:
        """Run the backbone and the head.

        `attention_mask`, when given, must be a float additive mask of shape
        [batch, 1, q_len, cache_len + q_len] (0 = attend, -inf = blocked). Without it the call is
        causal. `position_ids` default to cache_len .. cache_len + q_len - 1.
        """
        past = cache.get_seq_length() if cache is not None else 0
        q_len = input_ids.shape[1]
        if position_ids is None:
            position_ids = torch.arange(past, past + q_len, device=input_ids.device).unsqueeze(0)
        top = int(position_ids.max()) if position_ids.numel() else 0
        if top >= self.config.max_position_embeddings:
            raise ValueError(
                f"position {top} is beyond max_position_embeddings={self.config.max_position_embeddings}"
            )
        if attention_mask is not None:
            if attention_mask.dim() != 4 or not attention_mask.is_floating_point():
                raise ValueError("attention_mask must be a float additive 4-D mask [b, 1, q, kv]")
            if attention_mask.shape[-2:] != (q_len, past + q_len):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)}; expected [..., {q_len}, {past + q_len}]"
                )
            attention_mask = attention_mask.to(self.encoder.embed_tokens.weight.dtype)
        if use_cache is None:
            use_cache = cache is not None
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        out = self.encoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            **{CACHE_ARG: cache},
            **kwargs,
        )
        if use_cache and cache.get_seq_length() != past + q_len:
            # a backbone that ignored the cache would give wrong tokens without any error
            raise RuntimeError(
                f"the KV cache did not grow by the query length ({past} + {q_len} expected, "
                f"{cache.get_seq_length()} found): transformers did not use the cache passed as "
                f"`{CACHE_ARG}`; see selfspec.checkpoint.versions for the tested transformers range"
            )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.diffusion_head(hidden)
        return DiffusionLMOutput(
            logits=logits, cache=cache if use_cache else None, hidden_states=hidden if output_hidden_states else None
        )

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a checkpoint directory; every mismatch is an error that names the file or tensor."""
        path = os.fspath(pretrained_model_name_or_path)
        if os.path.isdir(path):
            check_checkpoint_dir(path)
        kwargs.setdefault("attn_implementation", "sdpa")
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(path, *args, output_loading_info=True, **kwargs)
        problems = []
        for key in ("missing_keys", "mismatched_keys"):
            if info.get(key):
                problems.append(f"{key.replace('_', ' ')}: {sorted(map(str, info[key]))[:8]}")
        unexpected = [k for k in info.get("unexpected_keys", []) if "rotary_emb" not in k]
        if unexpected:
            problems.append(f"unexpected keys: {sorted(unexpected)[:8]}")
        if problems:
            raise ValueError(f"checkpoint {path} does not match the model: " + "; ".join(problems))
        return (model, info) if want_info else model


def check_checkpoint_dir(path: str) -> None:
    """Fail fast, naming the file, key or tensor, before transformers builds anything."""
    cfg_path, raw = read_config_json(path)
    if raw.get("model_type") != NemotronLabsDiffusionConfig.model_type:
        raise ValueError(
            f"{cfg_path}: model_type is {raw.get('model_type')!r}, expected "
            f"{NemotronLabsDiffusionConfig.model_type!r}"
        )
    vocab, mask = raw.get("vocab_size"), raw.get("mask_token_id")
    if vocab is not None and mask is not None and not 0 <= mask < vocab:
        raise ValueError(f"{cfg_path}: mask_token_id {mask} is outside the vocabulary [0, {vocab})")
    check_safetensors_files(path)
    _check_tensor_shapes(path, raw)


def expected_shapes(raw: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape for a config dict, exactly as the NLD checkpoints name them."""
    h, v, f = raw["hidden_size"], raw["vocab_size"], raw["intermediate_size"]
    nq, nkv = raw["num_attention_heads"], raw.get("num_key_value_heads") or raw["num_attention_heads"]
    d = raw.get("head_dim") or h // nq
    shapes = {"encoder.embed_tokens.weight": (v, h), "encoder.norm.weight": (h,), "diffusion_head.weight": (v, h)}
    for i in range(raw["num_hidden_layers"]):
        p = f"encoder.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (nq * d, h)
        shapes[p + "self_attn.k_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.v_proj.weight"] = (nkv * d, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, nq * d)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    return shapes


def _check_tensor_shapes(path: str, raw: dict) -> None:
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
        files = ["model.safetensors"]
    else:
        return  # other formats: let transformers report
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for name in files:
        fp = os.path.join(path, name)
        if not os.path.isfile(fp):
            raise FileNotFoundError(f"{fp} is listed in the index but missing")
        with safe_open(fp, framework="pt") as sf:
            for key in sf.keys():
                found[key] = (tuple(sf.get_slice(key).get_shape()), name)
    for key, shape in expected_shapes(raw).items():
        if key not in found:
            raise ValueError(f"{path}: tensor {key!r} is missing from the checkpoint")
        if found[key][0] != shape:
            raise ValueError(f"{path}/{found[key][1]}: tensor {key!r} has shape {found[key][0]}, expected {shape}")


def register() -> None:
    """Make `AutoConfig` / `AutoModel` resolve model_type 'nemotron_labs_diffusion' locally."""
    try:
        AutoConfig.register(NemotronLabsDiffusionConfig.model_type, NemotronLabsDiffusionConfig)
    except ValueError:
        pass  # already registered
    try:
        AutoModel.register(NemotronLabsDiffusionConfig, NemotronLabsDiffusionModel)
    except ValueError:
        pass


def default_model_dir() -> str:
    """The default model's directory: $SELFSPEC_MODEL, else SmolLM2-135M-Instruct converted on first
    use (`selfspec.checkpoint.registry`)."""
    return resolve(None)


def load(path: str | None = None, *, dtype: torch.dtype | str | None = None, device: str | None = None,
         device_map=None, max_memory=None, draft_lora: bool = True):
    """(model, tokenizer) from a checkpoint directory or a model name (`registry.names()`); no
    argument loads the default model (SmolLM2-135M-Instruct, converted on first use).

    dtype defaults to float32 on CPU (exact greedy ties) and bfloat16 on CUDA. `device_map` /
    `max_memory` go to accelerate (e.g. device_map="auto" to spread a 14B over several GPUs);
    weights are initialised on the meta device and streamed from the safetensors shards.
    A `linear_spec_lora/` adapter is attached for drafting unless `draft_lora=False`.
    """
    from selfspec.checkpoint.tokenizer import load_tokenizer

    check_device(device)
    if device is None and device_map is None:
        device = "cpu"
    on_gpu = (device or "").startswith("cuda") or device_map is not None
    if dtype is None:
        dtype = torch.bfloat16 if on_gpu else torch.float32
    elif isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        dtype = getattr(torch, dtype)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating-point type; use float32, bfloat16 or float16")
    path = resolve(path)
    kw = {"dtype": dtype}
    if device_map is not None:
        kw["device_map"] = device_map
        if max_memory is not None:
            kw["max_memory"] = max_memory
    check_checkpoint_dir(path)
    if max_memory is not None:
        check_fits(path, dtype, max_memory)
    tokenizer = load_tokenizer(path)
    model = NemotronLabsDiffusionModel.from_pretrained(path, **kw)
    if device is not None and device_map is None:
        model = model.to(device)
    _merge_generation_eos(model, path)
    from selfspec.checkpoint.lora import load_draft_lora

    if draft_lora:
        model.draft_lora = load_draft_lora(model, path)
    from selfspec.drafting.learned_rho import Predictor

    model.presto_predictor = Predictor.load(path)  # not a submodule (`__setattr__`): it stays fp32
    return model.eval(), tokenizer


def _merge_generation_eos(model, path: str) -> None:
    """eos ids = config's plus generation_config.json's (either may be an int or a list)."""
    ids = model.config.eos_ids()
    gpath = os.path.join(path, "generation_config.json")
    if os.path.isfile(gpath):
        with open(gpath) as f:
            extra = json.load(f).get("eos_token_id")
        for e in [extra] if isinstance(extra, int) else (extra or []):
            if int(e) not in ids:
                ids.append(int(e))
    model.config.eos_token_id = ids[0] if len(ids) == 1 else (ids or None)


def _parse_bytes(v) -> int:
    if isinstance(v, (int, float)):
        return int(v)
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    s = str(v).strip().upper()
    for u, mult in units.items():
        if s.endswith(u):
            return int(float(s[: -len(u)]) * mult)
    return int(s)


def check_fits(path: str, dtype: torch.dtype, max_memory: dict) -> None:
    """Fail before loading when the weights cannot fit the devices in `max_memory`."""
    from safetensors import safe_open

    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    numel = 0
    for name in files:
        with safe_open(os.path.join(path, name), framework="pt") as sf:
            for key in sf.keys():
                n = 1
                for d in sf.get_slice(key).get_shape():
                    n *= d
                numel += n
    need = numel * torch.empty((), dtype=dtype).element_size()
    have = sum(_parse_bytes(v) for k, v in max_memory.items() if k != "disk")
    if need > have:
        raise ValueError(
            f"{path}: the weights need {need / 2**30:.3f} GiB in {dtype}, but max_memory allows "
            f"{have / 2**30:.3f} GiB on {sorted(map(str, max_memory))}; raise max_memory or use a smaller dtype"
        )
