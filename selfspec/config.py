"""Configuration: the checkpoint schema (`NemotronLabsDiffusionConfig`) and the decoding knobs.

The model config mirrors the released Nemotron-Labs-Diffusion config.json (see docs/model.md);
it is a Ministral-3 config plus the diffusion fields, so the Ministral-3 backbone from
transformers can be reused as is. Decoding options are a frozen dataclass validated at
construction, so bad input fails before any model work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from huggingface_hub.dataclasses import strict
from transformers import Ministral3Config

DLM_PARADIGMS = ("bidirectional", "autoregressive", "block_diff", "sbd_block_diff")
MODES = ("auto", "ar", "linear", "presto", "lookup")
PLANS = ("auto", "fixed")
SCHEDULES = ("two-pass", "one-pass")
RHOS = ("none", "ngram", "learned")


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


@dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """How to decode. Validated at construction; HF names where HF has one."""

    # plan "auto" (default): the layout of every round is chosen from the device's cost profile
    # (selfspec.planner); naming a mode fixes the layout ("fixed" alone means PRESTO one-pass)
    mode: str | None = None
    plan: str | None = None
    schedule: str = "one-pass"
    block_length: int = 16
    group_size: int | None = None  # one-pass mask-group size; None = block_length
    group_nodes: int | None = None  # one-pass: tree nodes that get a group; None = every node
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # sampling top-k (0 = off)
    top_p: float = 1.0
    budget: int = 32  # PRESTO draft nodes under the root (the root is not counted: the tree has budget + 1 nodes)
    tree_top_k: int = 4  # PRESTO candidates per depth
    lam: float = 0.2
    rho: str = "ngram"
    draft_lora: bool = True  # use the checkpoint's linear_spec_lora adapter (if any) on draft rows
    # context lookup: mode "lookup" drafts a chain copied from the context (prompt lookup);
    # `lookup` adds each path's context continuations to PRESTO's candidates (None: on for auto)
    lookup: bool | None = None
    lookup_min_ngram: int = 1
    lookup_max_ngram: int = 3
    lookup_tokens: int = 10

    def __post_init__(self):
        for f in fields(self):  # every float option, present and future: NaN / inf would poison scores or sampling
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v}")
        if self.plan is not None and self.plan not in PLANS:
            raise ValueError(f"unknown plan {self.plan!r}; expected one of {PLANS}")
        if self.mode is None:
            object.__setattr__(self, "mode", "presto" if self.plan == "fixed" else "auto")
        if self.plan == "auto" and self.mode != "auto":
            raise ValueError(f"plan 'auto' chooses the layout itself; drop mode={self.mode!r} or use plan='fixed'")
        object.__setattr__(self, "plan", "auto" if self.mode == "auto" else "fixed")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; expected one of {MODES}")
        if self.lookup is None:  # context candidates need a token-level rho: off with the learned one
            object.__setattr__(self, "lookup", self.mode == "auto" and self.rho != "learned")
        if not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError(f"need 1 <= lookup_min_ngram <= lookup_max_ngram; got lookup_min_ngram="
                             f"{self.lookup_min_ngram}, lookup_max_ngram={self.lookup_max_ngram}")
        if self.lookup_tokens < 1:
            raise ValueError(f"lookup_tokens must be >= 1, got {self.lookup_tokens}")
        if self.lookup and self.rho == "learned" and self.mode in ("presto", "auto"):
            raise ValueError("lookup candidates are scored with a token-level rho; use rho 'ngram' or 'none' with lookup, "
                             "or lookup=False with rho 'learned'")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; expected one of {SCHEDULES}")
        if self.block_length < 2:
            raise ValueError(f"block_length must be >= 2, got {self.block_length}")
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.group_nodes is not None and self.group_nodes < 1:
            raise ValueError(f"group_nodes must be >= 1, got {self.group_nodes}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.tree_top_k < 1:
            raise ValueError(f"tree_top_k (tree candidates per depth) must be >= 1, got {self.tree_top_k}")
        if self.lam < 0:
            raise ValueError(f"lam (PRESTO lambda) must be >= 0, got {self.lam}")
        if self.rho not in RHOS:
            raise ValueError(f"unknown rho {self.rho!r}; expected one of {RHOS}")

    @property
    def group(self) -> int:
        return self.group_size if self.group_size is not None else self.block_length

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
