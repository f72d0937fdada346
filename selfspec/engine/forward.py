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

from selfspec.checkpoint.lora import GROUPS, draft_rows
from selfspec.checkpoint.quant import matmul
from selfspec.engine.attention import model_grids
from selfspec.engine.rope import RopeTables
from selfspec.kernels import block as kb
from selfspec.kernels import layer as kl


# Fused q/k/v and gate/up copies save kernel calls, which matters for tiny models only, and
# double those weights in memory: SmolLM2-135M ran as fast unfused (B = 1 and 8) and the copies
# cost it hundreds of MB; the 9M model keeps them.
FUSE_MAX_PARAMS = 50_000_000


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the forward reads them (the model's own tensors, or fused copies)."""

    ln1: torch.Tensor  # input RMSNorm
    qkv: tuple[torch.Tensor, ...]  # (q_proj, k_proj, v_proj), or one fused [q; k; v]
    wo: torch.Tensor  # o_proj
    ln2: torch.Tensor  # post-attention RMSNorm
    gate_up: tuple[torch.Tensor, ...]  # (gate_proj, up_proj), or one fused [gate; up]
    down: torch.Tensor  # down_proj


class FastForward:
    """A `NemotronLabsDiffusionModel`'s weights as the forward reads them, its RoPE tables, the
    layer body (`layers_forward`) and the output head (`logits`)."""

    def __init__(self, model):
        cfg = model.config
        enc = model.encoder
        if getattr(cfg, "sliding_window", None) is not None:
            raise ValueError("the compact forward has no sliding-window attention; this checkpoint needs it")
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        rp = cfg.rope_parameters
        self.beta = float(rp.get("llama_4_scaling_beta") or 0.0)
        self.orig_max = int(rp["original_max_position_embeddings"])
        self.inv_freq = enc.rotary_emb.inv_freq.float()
        self.att_factor = float(enc.rotary_emb.attention_scaling)
        self.embed = enc.embed_tokens.weight.detach()
        self.dtype = self.embed.dtype
        fmt = _format_of(model)  # int8 / int4 weights quantized at load (`formats.set_weights`), or None
        self.weights = fmt.name if fmt is not None else _FP_NAMES.get(self.dtype, str(self.dtype))
        devices = {p.device.type for p in model.parameters()}
        # a row's logits bitwise the same at any width and in any batch: bf16 weight kernels (width-
        # invariant on a CPU), an fp32 residual stream and exact attention sums (`attention.py`)
        self.exact = self.dtype == torch.bfloat16 and devices == {"cpu"}
        self.act = torch.float32 if self.exact else self.dtype  # residual stream, norms, RoPE, MLP gate
        packed = fmt.weights if fmt is not None else {}
        # Fusing q/k/v and gate/up into one matmul each halves the per-layer kernel calls that
        # dominate small-batch decoding, at the price of a copy of those weights: done while that
        # copy is small (not an 8B on a GPU), and always for packed weights (packed fused at load)
        n_params = sum(p.numel() for p in model.parameters())
        self.fused = n_params <= FUSE_MAX_PARAMS or fmt is not None or self.exact
        self.layers = []
        for i, layer in enumerate(enc.layers):  # detached: read-only here (a trainer's LoRA gets the grads)
            at, mlp, pre = layer.self_attn, layer.mlp, f"encoder.layers.{i}."
            qkv = tuple(getattr(at, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj"))
            gu = (mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach())
            if self.fused:
                qkv = (packed[pre + "qkv"] if pre + "qkv" in packed else torch.cat(qkv, 0),)
                gu = (packed[pre + "gate_up"] if pre + "gate_up" in packed else torch.cat(gu, 0),)
            self.layers.append(LayerWeights(layer.input_layernorm.weight.detach().float() if self.exact else
                                            layer.input_layernorm.weight.detach(), qkv,
                                            packed.get(pre + "self_attn.o_proj.weight", at.o_proj.weight.detach()),
                                            layer.post_attention_layernorm.weight.detach().float() if self.exact else
                                            layer.post_attention_layernorm.weight.detach(), gu,
                                            packed.get(pre + "mlp.down_proj.weight", mlp.down_proj.weight.detach())))
        self.norm = enc.norm.weight.detach().to(self.act)
        self.head = packed.get("diffusion_head.weight", model.diffusion_head.weight.detach())
        self.devices = [layer.ln1.device for layer in self.layers]
        self.grids = model_grids(model, self.head_dim, self.beta, self.orig_max, self.att_factor) if self.exact else None
        self.rope = RopeTables(self.inv_freq, self.att_factor, self.beta, self.orig_max, self.n_heads, self.n_kv,
                               self.head_dim, self.dtype, self.grids)
        self._block = None  # (kernels.block's weight pointers or None,), made at first use

    @classmethod
    def of(cls, model) -> "FastForward":
        """The model's shared compact forward (`compact_forward`)."""
        return compact_forward(model)

    @staticmethod
    def supports(model) -> bool:
        """Weights all materialised (no meta / offloaded parameters) and no sliding window."""
        if getattr(model.config, "sliding_window", None) is not None:
            return False
        return not any(p.device.type == "meta" for p in parameters(model))

    # -- the forward ---------------------------------------------------------------------------
    def layers_forward(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, attend, lora=None,
                       lora_rows: slice | None = None, tail: tuple | None = None):
        """The decoder layers and final norm over embeddings h [R, q, H] of `tokens` ([q] or [R, q])
        at `positions` ([R, q] or [q]): the one layer body of the runtime's forward and of the
        draft-LoRA trainer. `attend(i, dev, q, k, v)` writes layer i's K/V and returns attention
        [R, heads, q, D] (q and k after RoPE; in the exact formats q, k and v on the attention grid,
        `attention.py`). The draft LoRA (`lora`) adds its deltas and mask embedding on query
        columns `lora_rows` of every row.

        The residual stream, norms and MLP gate run in `self.act` (fp32 in the exact formats); the
        weight matmuls take `self.dtype` (bf16 there: what the int8 / int4 kernels run).

        `tail` (exact formats only): (embeddings [m, H], positions [m]) of more query rows run in
        the same matmuls (another segment of rows: a prompt's chunk joining a round); `attend`
        then gets every row's fused heads flat ([R q + m, heads, D]) and returns [R q + m, heads x D],
        and the result is (final states [R, q, H], the tail's [m, H])."""
        R, q = int(h.shape[0]), int(h.shape[1])
        positions = positions.reshape(-1, q).expand(R, q)
        on = lora is not None and lora_rows is not None
        if on:
            h = lora.embed(tokens, h, lora_rows)
        if self.exact:
            out = None if tail is not None else self._one_call(h, positions, attend, lora if on else None, lora_rows)
            return out if out is not None else self._exact_layers(h, positions, attend, lora if on else None, lora_rows, tail)
        if tail is not None:
            raise ValueError("a tail of rows runs in the exact formats' layer body only")
        h = h.to(self.act)
        mm, tables = self.dtype, {}
        for i, w in enumerate(self.layers):
            dev = self.devices[i]
            if h.device != dev:
                h = h.to(dev)
            if dev not in tables:
                tables[dev] = self.rope.tables(positions, dev)
            x = _rms(h, w.ln1, self.eps).to(mm)
            qkv = (matmul(x, w.qkv[0]),) if len(w.qkv) == 1 else tuple(matmul(x, p) for p in w.qkv)
            if on:  # the runtime's LoRA adds in place into the fused output; a trainer's returns new tensors
                deltas = lora.add_deltas(i, GROUPS[0], x, self._split(qkv), lora_rows)
                qkv = qkv if self.exact else tuple(deltas)
            qs, ks, vs = self._rotate(qkv, tables[dev], R, q)
            a = attend(i, dev, qs, ks, vs).transpose(1, 2).reshape(R, q, -1)
            o = matmul(a.to(mm), w.wo)
            if on:
                o = lora.add_delta(i, a, o, lora_rows)
            h = h + o
            x = _rms(h, w.ln2, self.eps).to(mm)
            if len(w.gate_up) == 1:
                g, u = matmul(x, w.gate_up[0]).chunk(2, -1)
            else:
                g, u = matmul(x, w.gate_up[0]), matmul(x, w.gate_up[1])
            if on:
                g, u = lora.add_deltas(i, GROUPS[2], x, (g, u), lora_rows)
            m = F.silu(g) * u
            d = matmul(m.to(mm), w.down)
            if on:
                d = lora.add_deltas(i, GROUPS[3], m, (d,), lora_rows)[0]
            h = h + d
        return _rms(h, self.norm.to(h.device), self.eps)

    def _exact_layers(self, h: torch.Tensor, positions: torch.Tensor, attend, lora, lora_rows, tail=None):
        """`layers_forward` in the exact formats: the steps between the matmuls are `kernels.layer`'s
        (one C call each where torch runs several ops; the same bits from its torch twins), on rows
        flattened to [R q, ...]: RMSNorm into bf16, RoPE onto the attention grids, the residual
        added in place with the next norm, the MLP's gate. `attend` may return [R, q, heads x D]
        (`attention.exact_attention(heads_last=True)`) or [R, heads, q, D]; one marked
        `reads_fused` gets the q / k / v heads as one tensor [R, q, heads, D] (`fused=`; q, k and
        v None: `split_heads` makes them where it needs them)."""
        R, q, H = (int(n) for n in h.shape)
        M0, nh, nkv, D = R * q, self.n_heads, self.n_kv, self.head_dim
        h = h.reshape(M0, H).to(torch.float32, copy=True)  # the residual stream, updated in place
        if tail is not None:  # rows are independent outside the attention: the tail's ride in the same matmuls
            h = torch.cat([h, tail[0].to(torch.float32)])
            positions = torch.cat([positions.reshape(-1), tail[1].reshape(-1).to(positions.device)])
        M = int(h.shape[0])
        tables, vscale = {}, 2.0 ** self.grids[0].v
        last = len(self.layers) - 1
        x, fused = None, getattr(attend, "reads_fused", False)
        lrows = None if lora is None else draft_rows(R, q, lora_rows)
        for i, w in enumerate(self.layers):
            dev = self.devices[i]
            if h.device != dev:
                h, x = h.to(dev), None if x is None else x.to(dev)
            if dev not in tables:
                need = int(positions.max()) + 1
                tables[dev] = (positions.reshape(-1).to(dev), self.rope.full(need, dev))
            pos, tab = tables[dev]
            if x is None:
                x = kl.rms(h, w.ln1, self.eps)
            qkv = matmul(x, w.qkv[0])
            if lora is not None:  # in place (the tail has none)
                lora.add_fused(i, GROUPS[0], x, qkv, lrows, (nh * D, nkv * D, nkv * D))
            xs = kl.rope(qkv, pos, tab, nh, nkv, vscale)
            if tail is not None:
                a = attend(i, dev, None, None, None, fused=xs.view(M, nh + 2 * nkv, D))
            else:
                xs = xs.view(R, q, nh + 2 * nkv, D)
                a = attend(i, dev, None, None, None, fused=xs) if fused else attend(i, dev, *self.split_heads(xs))
                a = a if a.dim() == 3 else a.transpose(1, 2).reshape(R, q, -1)
            a = a.reshape(M, -1).to(self.dtype)
            o = matmul(a, w.wo)
            if lora is not None:
                lora.add_fused(i, GROUPS[1], a, o, lrows, (H,))
            x = kl.add_rms(h, o, w.ln2, self.eps)
            gu = matmul(x, w.gate_up[0])
            if lora is not None:
                lora.add_fused(i, GROUPS[2], x, gu, lrows, (gu.shape[-1] // 2,) * 2)
            m = kl.silu_mul(*gu.chunk(2, -1))
            d = matmul(m, w.down)
            if lora is not None:
                lora.add_fused(i, GROUPS[3], m, d, lrows, (H,))
            if i < last:
                x = kl.add_rms(h, d, self.layers[i + 1].ln1.to(dev), self.eps)
            else:
                x = kl.add_rms(h, d, self.norm.to(dev), self.eps, out_dtype=torch.float32)
        return x[:M0].view(R, q, H) if tail is None else (x[:M0].view(R, q, H), x[M0:])

    def one_call(self) -> bool:
        """Whether narrow rounds run all their layers in one C call (`kernels.block`): w4a8 weights
        on a CPU with the kernels built."""
        if self._block is None:
            cpu = self.exact and all(d.type == "cpu" for d in self.devices) and kb.available()
            self._block = (kb.weights_of(self.layers, self.norm, self.grids) if cpu else None,)
        return self._block[0] is not None

    def prepare_lora(self, lora) -> None:
        """Make a draft LoRA's tables now (the one-call block's where it runs, else the layer
        loop's), not in the first round that drafts, whose probe it made cost several times its
        prediction and its ledger charge a lost bet."""
        if lora is None:
            return
        if self.one_call():
            lora.block_args(len(self.layers), 1, 1, slice(0, None))
        else:
            lora.prepare(self.devices, exact=self.exact)

    def _one_call(self, h: torch.Tensor, positions: torch.Tensor, attend, lora=None, lora_rows=None):
        """Every layer in one C call (`kernels.block`) where it runs: w4a8 weights on a CPU, a compact
        cache and a round the one-call attention takes (`attend.block`: its cache rows and mask),
        with a draft LoRA too (`DraftLoRA.block_args`); the same kernels in the
        same order as `_exact_layers`, so the same bits -> the final states [R, q, H]. None
        elsewhere (nothing written)."""
        if getattr(attend, "block", None) is None or not self.one_call():
            return None
        lora_args = None
        if lora is not None and lora.enabled:
            lora_args = lora.block_args(len(self.layers), int(h.shape[0]), int(h.shape[1]), lora_rows)
        (R, q, H), (cache, row, starts, mask) = h.shape, attend.block(self.devices[0])
        if not (h.is_cpu and getattr(cache, "block16", False)):
            return None
        positions = positions.reshape(-1).contiguous()
        tab = self.rope.full(int(positions.max()) + 1, self.devices[0])
        out = kb.run(self._block[0], h.reshape(R * q, H).to(torch.float32, copy=True), positions, tab, R, q,
                     self.n_heads, self.n_kv, self.head_dim, cache, row, starts, mask, 2.0 ** self.grids[0].v, self.eps,
                     lora_args)
        return None if out is None else out.view(R, q, H)

    def split_heads(self, xs: torch.Tensor) -> tuple:
        """q, k, v [R, heads, q, D] (views) of the fused heads xs [R, q, nh + 2 kv, D]."""
        return tuple(t.transpose(1, 2) for t in xs.split((self.n_heads, self.n_kv, self.n_kv), 2))

    def _split(self, qkv: tuple) -> tuple:
        if len(qkv) == 3:
            return qkv
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        return qkv[0].split((nh * D, nkv * D, nkv * D), -1)

    def _rotate(self, qkv: tuple, r, R: int, q: int) -> tuple:
        """q, k, v [R, heads, q, D] from the projections: RoPE on q and k; in the exact formats all
        three in float64 onto the attention grid in one rotation (`tables`) and rounded there."""
        nh, nkv, D = self.n_heads, self.n_kv, self.head_dim
        if self.exact:
            x = qkv[0].double().view(R, q, nh + 2 * nkv, D)
            x = torch.addcmul(x * r[0], x.roll(D // 2, -1), r[1]).round_()
            qs, ks, vs = x.split((nh, nkv, nkv), 2)
            return qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)
        qs, ks, vs = (t.view(R, q, -1, D).transpose(1, 2) for t in self._split(qkv))
        qs = qs * r.q_cos + qs.roll(D // 2, -1) * r.q_sin
        ks = ks * r.k_cos + ks.roll(D // 2, -1) * r.k_sin
        return qs, ks, vs

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on the rows that are read (hidden [n, H] -> [n, V])."""
        dev = self.head.device if isinstance(self.head, torch.Tensor) else self.devices[-1]
        return matmul(hidden.to(dev, self.dtype), self.head)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


_FP_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _format_of(model):
    """The model's quantized weights, if they were made from its current weights (a `model.to`
    or an edit since makes them stale: the model's own weights are used then)."""
    fmt = model.__dict__.get("selfspec_weights")
    return fmt if fmt is not None and fmt.key == weights_key(model) else None


_ENGINE_LOCK = threading.Lock()


def weights_key(model) -> tuple:
    """Identity of the weights a `FastForward` copies or fuses: storage, dtype, device and in-place
    version of every parameter. `model.to(...)`, `.half()`, loading new weights or editing one in
    place all change it."""
    return tuple((p.data_ptr(), p.dtype, p.device, 0 if p.is_inference() else p._version) for p in parameters(model))


def parameters(model) -> list:
    """`list(model.parameters())` (the same tensors in the same order, a shared one once) by a plain
    walk over the modules' own dicts: read two to four times per generation (`weights_key`,
    `FastForward.supports`), where `Module.parameters()`' generic walk was most of a key's time."""
    out, seen, done = [], set(), set()

    def walk(m):
        if id(m) in done:
            return
        done.add(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        for c in m._modules.values():
            if c is not None:
                walk(c)

    walk(model)
    return out


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
