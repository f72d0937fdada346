"""The compact forward's weights and layer body over the model's own weights (gpt-fast style).

`NemotronLabsDiffusionModel.forward` (transformers' `Ministral3Model`) stays the reference: tests
hold the runtime's forward (`batch_forward.BatchForward`, which runs this layer body over one or
many cache rows) to it: fp32 logits within 1e-5, with masks, a cache and positions past the
original context. This one exists for speed: K/V written in place into the cache (no per-forward
concatenation), RoPE read from a table instead of recomputed per layer, fused q/k/v and gate/up
on small models, and the output head applied only to the rows a step reads
(`logits(hidden[rows])`), which on a small model is a third of the compute.

Math, per layer (as `Ministral3DecoderLayer`): RMSNorm (fp32 statistics), q/k/v projections,
YaRN RoPE (transformers' own inverse frequencies and attention factor), q scaled by
`1 + beta * log(1 + floor(pos / original_max))` (Llama-4 query scaling), SDPA with grouped KV
heads, o_proj, residual, SwiGLU MLP, residual; final norm. The draft LoRA (`lora.DraftLoRA`)
adds its deltas on draft rows (q/k/v before RoPE, o, gate/up, down) and its mask embedding.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F


# Fused q/k/v and gate/up copies save kernel calls, which matters for tiny models only, and
# double those weights in memory. Measured on 2 CPU cores: SmolLM2-135M AR at B = 1 and B = 8 was
# as fast unfused (19.7 vs 19.6 tok/s, 87.5 vs 85.8 at B = 8, one thread, 3 repeats) and the
# copies cost 279 MB; the 9M model keeps them.
FUSE_MAX_PARAMS = 50_000_000


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the forward reads them (the model's own tensors, or fused copies)."""

    ln1: torch.Tensor  # input RMSNorm
    qkv: tuple[torch.Tensor, ...]  # (q_proj, k_proj, v_proj), or one fused [q; k; v]
    wo: torch.Tensor  # o_proj
    ln2: torch.Tensor  # post-attention RMSNorm
    gate_up: tuple[torch.Tensor, ...]  # (gate_proj, up_proj), or one fused [gate; up]
    down: torch.Tensor  # down_proj


class Rope(NamedTuple):
    """RoPE tables: rows per position, sin signed for the rolled half, the query's times its scale."""

    q_cos: torch.Tensor
    q_sin: torch.Tensor
    k_cos: torch.Tensor
    k_sin: torch.Tensor


class FastForward:
    """A `NemotronLabsDiffusionModel`'s weights as the forward reads them, its RoPE tables, the
    layer body (`layers_forward`) and the output head (`logits`)."""

    def __init__(self, model):
        cfg = model.config
        enc = model.encoder
        if getattr(cfg, "sliding_window", None) is not None:
            raise ValueError("the compact forward has no sliding-window attention; this checkpoint needs it")
        self.model = model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rope = cfg.rope_parameters
        self.beta = float(rope.get("llama_4_scaling_beta") or 0.0)
        self.orig_max = int(rope["original_max_position_embeddings"])
        self.inv_freq = enc.rotary_emb.inv_freq.float()
        self.att_factor = float(enc.rotary_emb.attention_scaling)
        self.embed = enc.embed_tokens.weight.detach()
        # Fusing q/k/v and gate/up into one matmul each halves the per-layer kernel launches that
        # dominate small-batch decoding, at the price of a copy of those weights: done only while
        # that copy is small (the shipped model; not an 8B on a GPU).
        n_params = sum(p.numel() for p in model.parameters())
        self.fused = n_params <= FUSE_MAX_PARAMS
        self.layers = []
        for layer in enc.layers:  # detached: the base weights are read-only here (a trainer's LoRA gets the grads)
            at, mlp = layer.self_attn, layer.mlp
            qkv = (at.q_proj.weight.detach(), at.k_proj.weight.detach(), at.v_proj.weight.detach())
            gu = (mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach())
            if self.fused:
                qkv, gu = (torch.cat(qkv, 0),), (torch.cat(gu, 0),)
            self.layers.append(LayerWeights(layer.input_layernorm.weight.detach(), qkv, at.o_proj.weight.detach(),
                                            layer.post_attention_layernorm.weight.detach(), gu,
                                            mlp.down_proj.weight.detach()))
        self.norm = enc.norm.weight.detach()
        self.head = model.diffusion_head.weight.detach()
        self.dtype = self.embed.dtype
        self.weights = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype,
                                                                                                   str(self.dtype))
        self.devices = [w.wo.device for w in self.layers]
        # RoPE tables are shared read-only by every generation on this model; growing them is the
        # one write, done under a lock into new tensors that are swapped in whole
        self._lock = threading.Lock()
        self._tab = None  # (n, {device: Rope}), replaced as one object

    @classmethod
    def of(cls, model) -> "FastForward":
        """The model's shared compact forward (`compact_forward`)."""
        return compact_forward(model)

    @staticmethod
    def supports(model) -> bool:
        """Weights all materialised (no meta / offloaded parameters) and no sliding window."""
        if getattr(model.config, "sliding_window", None) is not None:
            return False
        return not any(p.device.type == "meta" for p in model.parameters())

    # -- position tables ---------------------------------------------------------------------
    def _make_tables(self, n: int) -> Rope:
        """Per position 0..n-1: the RoPE tables, with the sin signed and the query tables times
        the query scale.

        rotate_half(x) * sin == roll(x, D/2) * [-sin_lo, sin_hi], and the Llama-4 query scale
        multiplies the rotated query, so it folds into the query's tables.
        """
        pos = torch.arange(n, dtype=torch.float32)
        freqs = pos[:, None] * self.inv_freq[None, :].cpu()
        emb = torch.cat([freqs, freqs], -1)
        cos = (emb.cos() * self.att_factor).to(self.dtype)
        sin = (emb.sin() * self.att_factor).to(self.dtype)
        h = sin.shape[-1] // 2
        sin = torch.cat([-sin[:, :h], sin[:, h:]], -1)
        scale = (1 + self.beta * torch.log(1 + torch.floor(pos / self.orig_max))).to(self.dtype)[:, None]
        return Rope(cos * scale, sin * scale, cos, sin)

    def rope_tables(self, positions: torch.Tensor, device=None) -> Rope:
        """The tables' rows for `positions` ([q]), each [1, 1, q, D], on `device` (default: the first layer's)."""
        return self._rope(positions, device or self.devices[0])

    def _rope(self, positions: torch.Tensor, device) -> Rope:
        """The tables' rows for `positions`, each [1, 1, q, D], on `device`."""
        need = int(positions.max()) + 1
        tab = self._tab
        if tab is None or tab[0] < need or device not in tab[1]:
            with self._lock:
                tab = self._tab
                if tab is None or tab[0] < need:
                    n = max(need, 2 * (0 if tab is None else tab[0]), 256)
                    tab = (n, {"base": self._make_tables(n)})
                if device not in tab[1]:
                    tab = (tab[0], {**tab[1], device: Rope(*(t.to(device) for t in tab[1]["base"]))})
                self._tab = tab
        p = positions.to(device)
        return Rope(*(t[p][None, None] for t in tab[1][device]))

    # -- the forward ---------------------------------------------------------------------------
    def layers_forward(self, tokens: torch.Tensor, h: torch.Tensor, rope, attend, lora=None,
                       lora_rows: slice | None = None) -> torch.Tensor:
        """The decoder layers and final norm over embeddings h [R, q, H] of `tokens` ([q] or [R, q]):
        the one layer body of the batch-1 and the batched forward. `rope(dev)` gives the `Rope`
        tables broadcastable to [R, heads, q, D]; `attend(i, dev, q, k, v)` writes layer i's K/V
        and returns attention [R, heads, q, D]. The draft LoRA (`lora`) adds its deltas and mask
        embedding on query columns `lora_rows` of every row."""
        R, q = int(h.shape[0]), int(h.shape[1])
        on = lora is not None and lora_rows is not None
        if on:
            h = lora.embed(tokens, h, lora_rows)
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        ropes = {}
        for i, w in enumerate(self.layers):
            dev = self.devices[i]
            if h.device != dev:
                h = h.to(dev)
            if dev not in ropes:
                ropes[dev] = rope(dev)
            r = ropes[dev]
            x = _rms(h, w.ln1, self.eps)
            if len(w.qkv) == 1:
                qs, ks, vs = F.linear(x, w.qkv[0]).split((nh * D, nkv * D, nkv * D), -1)
            else:
                qs, ks, vs = (F.linear(x, p) for p in w.qkv)
            if on:
                qs, ks, vs = lora.add_deltas(i, ("q_proj", "k_proj", "v_proj"), x, (qs, ks, vs), lora_rows)
            qs = qs.view(R, q, nh, D).transpose(1, 2)
            ks = ks.view(R, q, nkv, D).transpose(1, 2)
            vs = vs.view(R, q, nkv, D).transpose(1, 2)
            qs = qs * r.q_cos + qs.roll(D // 2, -1) * r.q_sin
            ks = ks * r.k_cos + ks.roll(D // 2, -1) * r.k_sin
            a = attend(i, dev, qs, ks, vs).transpose(1, 2).reshape(R, q, nh * D)
            o = F.linear(a, w.wo)
            if on:
                o = lora.add_delta(i, a, o, lora_rows)
            h = h + o
            x = _rms(h, w.ln2, self.eps)
            if len(w.gate_up) == 1:
                g, u = F.linear(x, w.gate_up[0]).chunk(2, -1)
            else:
                g, u = F.linear(x, w.gate_up[0]), F.linear(x, w.gate_up[1])
            if on:
                g, u = lora.add_deltas(i, ("gate_proj", "up_proj"), x, (g, u), lora_rows)
            m = F.silu(g) * u
            d = F.linear(m, w.down)
            if on:
                d = lora.add_deltas(i, ("down_proj",), m, (d,), lora_rows)[0]
            h = h + d
        return _rms(h, self.norm.to(h.device), self.eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on the rows that are read (hidden [n, H] -> [n, V])."""
        return F.linear(hidden.to(self.head.device), self.head)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


_ENGINE_LOCK = threading.Lock()


def weights_key(model) -> tuple:
    """Identity of the weights a `FastForward` copies or fuses: storage, dtype, device and in-place
    version of every parameter. `model.to(...)`, `.half()`, loading new weights or editing one in
    place all change it."""
    return tuple((p.data_ptr(), p.dtype, p.device, p._version) for p in model.parameters())


def compact_forward(model) -> FastForward:
    """The model's compact forward: made once, remade when the weights change (in place, or by
    `model.to(dtype / device)`). Generations in several threads share it: it holds only
    read-only state (weights, RoPE tables); each request's scratch lives in its `cache.BatchKVCache`."""
    key = weights_key(model)
    ff = model.__dict__.get("_selfspec_forward")
    if ff is not None and ff[1] == key:
        return ff[0]
    with _ENGINE_LOCK:
        ff = model.__dict__.get("_selfspec_forward")
        if ff is None or ff[1] != key:
            ff = (FastForward(model), key)
            model.__dict__["_selfspec_forward"] = ff
    return ff[0]
