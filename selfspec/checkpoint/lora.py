"""The draft LoRA of NLD instruct checkpoints (`linear_spec_lora/`), applied to draft rows only.

Upstream ships a PEFT adapter on every layer's `o_proj` (r = 128, alpha = 512) and uses it only
while drafting. `o_proj` acts per token, so the delta `scale * (x A^T) B^T` can be added to the
mask rows of a mixed forward and nothing else: verification rows never attend to mask rows, so
their logits stay exact. The adapter is attached with forward hooks (public PyTorch API); no
transformers code is touched, and peft is not needed at run time.
"""

from __future__ import annotations

import json
import os
import re
from contextlib import contextmanager

import torch

LORA_DIR = "linear_spec_lora"
_KEY = re.compile(r"(?:base_model\.model\.)?encoder\.layers\.(\d+)\.self_attn\.o_proj\.lora_([AB])(?:\.default)?\.weight$")


class DraftLoRA:
    """Holds A/B per layer; `rows` selects the query rows that get the delta (None = off)."""

    def __init__(self, model, weights: dict[int, tuple[torch.Tensor, torch.Tensor]], scale: float):
        self.scale = scale
        self.rows: torch.Tensor | slice | None = None
        self.enabled = True
        self._handles = []
        self.ab: list[tuple[torch.Tensor, torch.Tensor]] = []
        for i, layer in enumerate(model.encoder.layers):
            a, b = weights[i]
            proj = layer.self_attn.o_proj
            a = a.to(proj.weight.device, proj.weight.dtype)
            b = b.to(proj.weight.device, proj.weight.dtype)
            self.ab.append((a, b))
            self._handles.append(proj.register_forward_hook(self._hook(a, b)))

    def add_delta(self, layer: int, x: torch.Tensor, out: torch.Tensor, rows) -> torch.Tensor:
        """`out` (o_proj of `x`, [1, q, H]) plus the delta on `rows`: the compact forward's path."""
        if not self.enabled:
            return out
        a, b = self.ab[layer]
        if a.dtype != x.dtype or a.device != x.device:  # the model was moved (`model.to(...)`) after loading
            a, b = self._moved(layer, x.dtype, x.device)
        out[:, rows] += (x[:, rows] @ a.T) @ b.T * self.scale
        return out

    def _moved(self, layer: int, dtype, device):
        moved = self.__dict__.setdefault("_moved_ab", {})
        ab = moved.get((dtype, device))
        if ab is None:
            ab = moved[(dtype, device)] = [(a.to(device, dtype), b.to(device, dtype)) for a, b in self.ab]
        return ab[layer]

    def _hook(self, a, b):
        def hook(module, inputs, output):
            if self.rows is None or not self.enabled:
                return None
            x = inputs[0][:, self.rows]
            a_, b_ = (a, b) if a.dtype == x.dtype and a.device == x.device else (a.to(x), b.to(x))
            delta = (x @ a_.T) @ b_.T * self.scale
            output = output.clone()
            output[:, self.rows] += delta
            return output

        return hook

    @contextmanager
    def on(self, rows):
        """Apply the delta to `rows` (a slice or index tensor over query positions) inside the block."""
        prev, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = prev

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def load_draft_lora(model, checkpoint_dir: str) -> DraftLoRA | None:
    """Attach `<checkpoint_dir>/linear_spec_lora` if present; every mismatch is a named error."""
    path = os.path.join(checkpoint_dir, LORA_DIR)
    if not os.path.isdir(path):
        return None
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} has no adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not r or alpha is None:
        raise ValueError(f"{cfg_path}: needs 'r' and 'lora_alpha'")
    targets = cfg.get("target_modules") or ["o_proj"]
    if any("o_proj" not in t for t in targets):
        raise ValueError(f"{cfg_path}: only o_proj adapters are supported, got target_modules={targets}")
    from safetensors.torch import load_file

    wpath = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(wpath):
        raise FileNotFoundError(f"{path} has no adapter_model.safetensors")
    raw = load_file(wpath)
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.search(key)
        if m:
            found.setdefault(int(m.group(1)), {})[m.group(2)] = t
    weights = {}
    for i, layer in enumerate(model.encoder.layers):
        proj = layer.self_attn.o_proj
        ab = found.get(i, {})
        if "A" not in ab or "B" not in ab:
            raise ValueError(f"{wpath}: layer {i} o_proj lora_A/lora_B missing")
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, proj.in_features) or tuple(b.shape) != (proj.out_features, r):
            raise ValueError(
                f"{wpath}: layer {i} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit o_proj "
                f"[{proj.out_features}, {proj.in_features}] with r={r}"
            )
        weights[i] = (a, b)
    return DraftLoRA(model, weights, float(alpha) / float(r))
