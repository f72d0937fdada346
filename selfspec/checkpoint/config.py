"""The checkpoint schema: `NemotronLabsDiffusionConfig`.

It mirrors the released Nemotron-Labs-Diffusion config.json (see docs/models.md): a Ministral-3
config plus the diffusion fields, so the Ministral-3 backbone from transformers is reused as is.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Ministral3Config

DLM_PARADIGMS = ("bidirectional", "autoregressive", "block_diff", "sbd_block_diff")


@strict
class NemotronLabsDiffusionConfig(Ministral3Config):
    """Ministral-3 backbone config plus the fields of the NLD checkpoints.

    Unknown (training-only) keys are kept as attributes, never rejected.
    """

    model_type = "nemotron_labs_diffusion"

    mask_token_id: int = 100
    block_size: int = 32
    dlm_paradigm: str = "bidirectional"
    dlm_loss_weight: float | None = None
    ar_loss_weight: float | None = 1.0
    dp_varying_mask_ratio: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"config key 'mask_token_id' = {self.mask_token_id} is outside the vocabulary "
                f"[0, {self.vocab_size})"
            )
        if self.dlm_paradigm not in DLM_PARADIGMS:
            raise ValueError(f"config key 'dlm_paradigm' = {self.dlm_paradigm!r}; expected one of {DLM_PARADIGMS}")
        rope = self.rope_parameters or {}
        for key in ("original_max_position_embeddings", "llama_4_scaling_beta"):
            if key not in rope:
                raise ValueError(f"config key 'rope_parameters' lacks {key!r} (needed for Llama-4 query scaling)")

    def eos_ids(self) -> list[int]:
        """The configured eos ids as a list (the config may hold an int or a list)."""
        eos = self.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]
