"""The vLLM model class for NLD checkpoints; imported by vLLM itself (see `vllm.py`), needs vLLM.

An NLD backbone is transformers' Ministral-3: a Llama decoder with YaRN rotary embeddings and the
Llama-4 query scaling `1 + beta * log(1 + floor(pos / original_max_position_embeddings))`.
vLLM's `MistralForCausalLM` (vllm/model_executor/models/mistral.py) implements exactly that, and
its `get_rope` reads YaRN (factor, beta_fast/slow, mscale, mscale_all_dim) from the config's
`rope_parameters`. Two things differ from a Ministral-3 checkpoint, and both are handled here:

* vLLM reads the query scaling from a top-level `config.llama_4_scaling` dict, which an HF
  Ministral-3 config does not have (it keeps `llama_4_scaling_beta` inside `rope_parameters`);
  without it vLLM silently skips the scaling and positions past
  `original_max_position_embeddings` get wrong logits. It is set from the checkpoint.
* the weights are named `encoder.*` and `diffusion_head.weight` (untied), and the directory may
  hold other safetensors files (e.g. `presto_predictor.safetensors`): only `model*.safetensors`
  are read, and every name goes through `vllm.vllm_weight_name` (unknown name -> error naming it).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from vllm.config import VllmConfig
from vllm.model_executor.models.mistral import MistralForCausalLM

from .vllm import llama_4_scaling, map_weights


class NemotronLabsDiffusionForCausalLM(MistralForCausalLM):
    # the backbone's shards only: a checkpoint directory also holds the PRESTO predictor's file
    allow_patterns_overrides = ["model*.safetensors"]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs):
        config = vllm_config.model_config.hf_config
        scaling = llama_4_scaling(config)
        if scaling is None:
            raise ValueError("the checkpoint's rope_parameters lack llama_4_scaling_beta; "
                             "an NLD checkpoint always has it")
        config.llama_4_scaling = scaling  # where MistralAttention looks for it
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError("NLD checkpoints have an untied diffusion_head; this config ties it")
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(map_weights(weights))
        expected = {name for name, _ in self.named_parameters()}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"the checkpoint lacks tensors for {missing[:8]} (vLLM names)")
        return loaded
