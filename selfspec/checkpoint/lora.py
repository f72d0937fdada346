"""The draft LoRA of NLD checkpoints (`linear_spec_lora/`), applied to draft rows only.

Upstream ships a PEFT adapter on every layer's `o_proj` (r = 128, alpha = 512) and uses it only
while drafting. Adapters trained here (`selfspec.training.draft_lora`) may target any of
q/k/v/o/gate/up/down and may carry `mask_embedding` [H], the embedding used for mask tokens on
draft rows. Every target acts per token (q/k/v before RoPE), so the delta
`scale * (x A^T) B^T` can be added to the draft rows of a mixed forward and nothing else:
verification rows never attend to draft rows, so their logits stay exact. The reference path
attaches the adapter with forward hooks (public PyTorch API); no transformers code is touched,
and peft is not needed at run time.

An adapter whose config names `base_model_hash` is refused unless it equals `base_model_hash(model)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager

import torch

from selfspec.kernels import layer as kl
from selfspec.kernels import w4a8

LORA_DIR = "linear_spec_lora"
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN + MLP
# the modules that read one input, in the order of the compact forward's fused outputs (q|k|v, gate|up)
GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
MASK_EMBEDDING = "mask_embedding"
_KEY = re.compile(r"(?:base_model\.model\.)?encoder\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")


def draft_rows(R: int, q: int, cols: slice) -> torch.Tensor:
    """Flat indices (R rows of q query tokens) of the query columns `cols` of every row.

    Example: draft_rows(2, 4, slice(1, None)) -> [1, 2, 3, 5, 6, 7]."""
    return (torch.arange(R)[:, None] * q + torch.arange(q)[cols]).reshape(-1)


def module_of(layer, name: str) -> torch.nn.Linear:
    """The Linear `name` (one of TARGETS) of a decoder layer."""
    return getattr(layer.self_attn if name in ATTN else layer.mlp, name)


def peft_key(layer: int, name: str, ab: str) -> str:
    return f"base_model.model.encoder.layers.{layer}.{'self_attn' if name in ATTN else 'mlp'}.{name}.lora_{ab}.weight"


def base_model_hash(model) -> str:
    """sha1 over the architecture and checksums of a few base tensors: identifies the base weights."""
    cfg = model.config
    h = hashlib.sha1()
    arch = {k: getattr(cfg, k, None) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                               "num_attention_heads", "num_key_value_heads", "head_dim",
                                               "mask_token_id")}
    h.update(json.dumps(arch, sort_keys=True).encode())
    enc = model.encoder
    picks = [enc.embed_tokens.weight, enc.norm.weight, model.diffusion_head.weight]
    for layer in (enc.layers[0], enc.layers[-1]):
        picks += [layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight]
    with torch.no_grad():
        for t in picks:
            # bf16-rounded, summed in float64 on the CPU: the same for a float32 or a bfloat16 load
            flat = t.detach().flatten()
            t = flat[:: max(1, flat.numel() // 250_000)].cpu().to(torch.bfloat16).double()  # a strided sample
            h.update(f"{tuple(t.shape)}:{t.sum().item():.6e}:{t.abs().sum().item():.6e}:{t.flatten()[:64].tolist()}".encode())
    return h.hexdigest()


class DraftLoRA:
    """Holds A/B per (layer, target); `rows` selects the query rows that get the delta (None = off).

    `weights`: {layer: (A, B)} (o_proj, the upstream form) or {(layer, target): (A, B)}.
    `mask_embedding` [H] (optional) replaces the embedding of `mask_token_id` on draft rows.
    """

    def __init__(self, model, weights: dict, scale: float, mask_embedding: torch.Tensor | None = None):
        self.scale = scale
        self.rows: torch.Tensor | slice | None = None
        self.enabled = True
        self._handles = []
        self.mask_id = int(model.config.mask_token_id)
        emb = model.encoder.embed_tokens.weight
        self.mask_embedding = None if mask_embedding is None else mask_embedding.to(emb.device, emb.dtype)
        self.ab: dict[str, list] = {}  # target -> per layer (A, B) or None
        n = len(model.encoder.layers)
        for key, (a, b) in weights.items():
            i, name = (key, "o_proj") if isinstance(key, int) else key
            w = module_of(model.encoder.layers[i], name).weight
            self.ab.setdefault(name, [None] * n)[i] = (a.to(w.device, w.dtype), b.to(w.device, w.dtype))
        self.targets = tuple(t for t in TARGETS if t in self.ab)
        for name in self.targets:
            for i, layer in enumerate(model.encoder.layers):
                if self.ab[name][i] is not None:
                    self._handles.append(module_of(layer, name).register_forward_hook(self._hook(name, i)))
        if self.mask_embedding is not None:
            self._handles.append(model.encoder.embed_tokens.register_forward_hook(self._embed_hook))

    # -- the compact forward's path ------------------------------------------------------------------
    def add_delta(self, layer: int, x: torch.Tensor, out: torch.Tensor, rows) -> torch.Tensor:
        """`out` (o_proj of `x`, [R, q, H]) plus the o_proj delta on `rows`."""
        return self.add_deltas(layer, ("o_proj",), x, (out,), rows)[0]

    def add_deltas(self, layer: int, names: tuple[str, ...], x: torch.Tensor, outs: tuple, rows) -> tuple:
        """Each `outs[j]` (= module names[j] of `x`, [R, q, out]) plus its delta on `rows`, in place.
        The modules that share `x` take one delta: x A^T with their A stacked, times their scaled
        B on a block diagonal (two matmuls instead of two per module: a one-pass round's LoRA is
        hundreds of tiny matmuls, and each costs its call, not its arithmetic)."""
        fused = self._fused(layer, names, x.device) if self.enabled else None
        if fused is None:
            return outs
        a, b, widths = fused
        xr = x[:, rows]
        # one 2-D fp32 matrix: a strided 3-D slice times a weight is a batched matmul over copies of
        # it, and a bf16 matmul this small costs several times fp32's on a CPU
        delta = ((xr.reshape(-1, xr.shape[-1]).float() @ a) @ b).view(*xr.shape[:-1], -1)
        start = 0
        for out, n in zip(outs, widths):
            if n:
                out[:, rows] += delta[..., start : start + n]
                start += n
        return outs

    def add_fused(self, layer: int, names: tuple[str, ...], x: torch.Tensor, out: torch.Tensor,
                  rows: torch.Tensor, cols: tuple[int, ...]) -> None:
        """out[rows] += the delta of the modules `names` of one group (`GROUPS`), in place: x [M, K]
        their input, out [M, N] their fused output (module j's `cols[j]` columns side by side), rows
        the flat draft rows (int64). Module by module (`kernels.w4a8.lora` on its columns: the layer
        loop and the one-call block give the drafts the same bits); a group stacked as one rank-48
        product would multiply a block-diagonal B whose other modules' rows are zeros: two thirds of
        q|k|v's B, half of gate|up's, read and multiplied for nothing."""
        if not self.enabled:
            return
        col = 0
        for ab, n_out in zip(self._modules(layer, names, x.device), cols):
            if ab is not None:
                w4a8.lora(x, ab[0], ab[1], out[:, col : col + n_out], rows)
            col += n_out

    def block_args(self, n_layers: int, R: int, q: int, cols: slice):
        """What the one-call block (`kernels.layer.run_block`) takes to add the deltas on query columns
        `cols` of R rows of q tokens: every layer's modules (`kernels.layer.block_lora`, in `GROUPS`
        order; a module without LoRA, part of a group too, gets a null entry) and the flat draft
        rows."""
        memo = self.__dict__.get("_block_ptrs")
        if memo is None:
            mods = [self._modules(i, names, torch.device("cpu")) for i in range(n_layers) for names in GROUPS]
            memo = self.__dict__["_block_ptrs"] = kl.block_lora([ab for g in mods for ab in g])
        return memo, draft_rows(R, q, cols)

    def _modules(self, layer: int, names: tuple[str, ...], device: torch.device) -> list:
        """Per module of `names`: its int8 tables (`kernels.w4a8.pack_lora` of A and scale * B, from
        the stored fp32), or None without LoRA; kept per layer, modules and device (the exact
        formats run on a CPU)."""
        memo = self.__dict__.setdefault("_module_ab", {})
        key = (layer, names, device)
        if key not in memo:
            memo[key] = [None if name not in self.ab or self.ab[name][layer] is None else
                         w4a8.pack_lora(self.ab[name][layer][0].float(), self.ab[name][layer][1].float() * self.scale)
                         for name in names]
        return memo[key]

    def prepare(self, devices: list, *, exact: bool) -> None:
        """Every layer's tables on its device (`devices[i]`) now, not in the first round that
        drafts: the exact formats' per module (`_modules`, `add_fused`), the others' stacked per
        group (`_fused`, `add_deltas`)."""
        make = self._modules if exact else self._fused
        for i, device in enumerate(devices):
            for names in GROUPS:
                make(i, names, device)

    def _fused(self, layer: int, names: tuple[str, ...], device: torch.device):
        """(A stacked and scale * B block-diagonal, both fp32 and transposed for x @ A^T @ B^T; each
        module's output width, 0 without LoRA) on `device`, kept per layer, modules and device."""
        memo = self.__dict__.setdefault("_fused_ab", {})
        key = (layer, names, device)
        if key not in memo:  # from the stored A/B: `_ab` would round them to x's dtype first (bf16)
            abs_ = [self.ab[name][layer] if name in self.ab else None for name in names]
            abs_ = [None if ab is None else tuple(t.to(device, torch.float32) for t in ab) for ab in abs_]
            present = [ab for ab in abs_ if ab is not None]
            memo[key] = None if not present else (
                torch.cat([a for a, _ in present]).T.contiguous(),
                torch.block_diag(*[b * self.scale for _, b in present]).T.contiguous(),
                [0 if ab is None else ab[1].shape[0] for ab in abs_])
        return memo[key]

    def embed(self, tokens: torch.Tensor, h: torch.Tensor, rows) -> torch.Tensor:
        """`h` ([R, q, H], the embedding of `tokens` [q] or [R, q]) with the mask embedding on mask
        tokens in query columns `rows` of every row."""
        if not self.enabled or self.mask_embedding is None:
            return h
        t = tokens.reshape(-1, tokens.shape[-1]).to(h.device)
        sel = torch.zeros_like(t, dtype=torch.bool)
        sel[:, rows] = True
        sel &= t == self.mask_id
        # a select, not h[sel] = ...: boolean indexing (and asking whether any is set) reads the
        # tensor on the host, a device sync in every drafting round
        return torch.where(sel[..., None], self.mask_embedding.to(h.device, h.dtype), h)

    def _ab(self, name: str, layer: int, x: torch.Tensor):
        per = self.ab.get(name)
        if per is None or per[layer] is None:
            return None
        a, b = per[layer]
        if a.dtype != x.dtype or a.device != x.device:  # the model was moved (`model.to(...)`) after loading
            moved = self.__dict__.setdefault("_moved_ab", {})
            key = (name, layer, x.dtype, x.device)
            if key not in moved:
                moved[key] = (a.to(x.device, x.dtype), b.to(x.device, x.dtype))
            a, b = moved[key]
        return a, b

    # -- the reference path (hooks on the transformers modules) --------------------------------------
    def _hook(self, name: str, layer: int):
        def hook(module, inputs, output):
            if self.rows is None or not self.enabled:
                return None
            a, b = self._ab(name, layer, inputs[0])
            delta = (inputs[0][:, self.rows] @ a.T) @ b.T * self.scale
            output = output.clone()
            output[:, self.rows] += delta
            return output

        return hook

    def _embed_hook(self, module, inputs, output):
        if self.rows is None or not self.enabled:
            return None
        ids = inputs[0]
        sel = torch.zeros(ids.shape[-1], dtype=torch.bool, device=ids.device)
        sel[self.rows] = True
        sel = sel[None] & (ids == self.mask_id)
        output = output.clone()
        output[sel] = self.mask_embedding.to(output.device, output.dtype)
        return output

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
    if isinstance(targets, str):
        targets = [targets]
    names = []
    for t in targets:
        hit = [n for n in TARGETS if t == n or t.endswith("." + n)]
        if not hit:
            raise ValueError(f"{cfg_path}: unsupported target module {t!r} (supported: {', '.join(TARGETS)})")
        names.append(hit[0])
    want = cfg.get("base_model_hash")
    if want is not None:
        have = base_model_hash(model)
        if want != have:
            raise ValueError(f"{cfg_path}: base_model_hash {want} does not match this model's weights ({have}); "
                             "the adapter was trained for another base")
    from safetensors.torch import load_file

    wpath = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(wpath):
        raise FileNotFoundError(f"{path} has no adapter_model.safetensors")
    raw = load_file(wpath)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in raw.items():
        m = _KEY.search(key)
        if m:
            found.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    weights = {}
    for name in names:
        for i, layer in enumerate(model.encoder.layers):
            proj = module_of(layer, name)
            ab = found.get((i, name), {})
            if "A" not in ab or "B" not in ab:
                raise ValueError(f"{wpath}: {name} layer {i} lora_A/lora_B missing")
            a, b = ab["A"], ab["B"]
            if tuple(a.shape) != (r, proj.in_features) or tuple(b.shape) != (proj.out_features, r):
                raise ValueError(
                    f"{wpath}: {name} layer {i} lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit "
                    f"{name} [{proj.out_features}, {proj.in_features}] with r={r}"
                )
            weights[(i, name)] = (a, b)
    mask_emb = raw.get(MASK_EMBEDDING)
    if mask_emb is not None:
        H = model.config.hidden_size
        if tuple(mask_emb.shape) != (H,):
            raise ValueError(f"{wpath}: {MASK_EMBEDDING} has shape {tuple(mask_emb.shape)}, expected ({H},)")
    return DraftLoRA(model, weights, float(alpha) / float(r), mask_embedding=mask_emb)
