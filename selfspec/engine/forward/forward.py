"""The compact forward: the model's own weights, RoPE tables and the one layer body (gpt-fast style).

`NemotronLabsDiffusionModel.forward` (transformers' `Ministral3Model`) stays the reference: tests
hold the runtime's forward (`batch_forward.BatchForward`, which runs this layer body over one or
many cache rows) to it: fp32 logits within 1e-5, with masks, a cache and positions past the
original context. This one exists for speed: K/V written in place into the cache, RoPE read from
a table, fused q/k/v and gate/up on small models, and the output head applied only to the rows a
step reads (`logits(hidden[rows])`), which on a small model is a third of the compute.

Math, per layer (as `Ministral3DecoderLayer`): RMSNorm (fp32 statistics), q/k/v projections,
YaRN RoPE (transformers' own inverse frequencies and attention factor), q scaled by
`1 + beta * log(1 + floor(pos / original_max))` (Llama-4 query scaling), attention with grouped
KV heads, o_proj, residual, SwiGLU MLP, residual; final norm. The draft LoRA (`lora.DraftLoRA`)
adds its deltas on draft rows (q/k/v before RoPE, o, gate/up, down) and its mask embedding.

The layer body is written once (`FastForward._layers`); the formats differ only in the arithmetic
of its steps (`FloatSteps`: torch ops; `ExactSteps`: `kernels.layer`'s C steps onto exact
attention grids). `kernels.layer.run_block` runs the exact steps in the same order as one C call, its
bit-tested twin. Nothing here reads a tensor's value on the host: positions arrive built and the
RoPE tables' length as a Python int, so a round's forward has no device-to-host sync.
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F

from selfspec.checkpoint.lora import GROUPS, draft_rows
from selfspec.checkpoint.quant import parameters, quantized_of, weights_key
from selfspec.engine.forward.attention import Rope, RopeTables, model_grids
from selfspec.kernels import layer as kl


# Fused q/k/v and gate/up copies save kernel calls, which matters for tiny models only, and
# double those weights in memory: SmolLM2-135M ran as fast unfused (B = 1 and 8) and the copies
# cost it hundreds of MB; the 9M model keeps them.
FUSE_MAX_PARAMS = 50_000_000


def matmul(x: torch.Tensor, w) -> torch.Tensor:
    """x @ w.T for a plain weight tensor or a quantized one (`checkpoint.quant`: callable)."""
    return F.linear(x, w) if isinstance(w, torch.Tensor) else w(x)


class LayerWeights(NamedTuple):
    """One decoder layer's weights as the forward reads them (the model's own tensors, or fused copies)."""

    ln1: torch.Tensor  # input RMSNorm
    qkv: tuple[torch.Tensor, ...]  # (q_proj, k_proj, v_proj), or one fused [q; k; v]
    wo: torch.Tensor  # o_proj
    ln2: torch.Tensor  # post-attention RMSNorm
    gate_up: tuple[torch.Tensor, ...]  # (gate_proj, up_proj), or one fused [gate; up]
    down: torch.Tensor  # down_proj


class Shape(NamedTuple):
    """R rows of q queries, M rows in all (a tail adds some), the exact attention's fused heads' shape."""

    R: int
    q: int
    M: int
    fused: tuple


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
        fmt = quantized_of(model)  # int8 / int4 weights quantized at load (`formats.set_weights`), or None
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
        norm = (lambda t: t.detach().float()) if self.exact else (lambda t: t.detach())  # noqa: E731
        self.layers = []
        for i, layer in enumerate(enc.layers):  # detached: read-only here (a trainer's LoRA gets the grads)
            at, mlp, pre = layer.self_attn, layer.mlp, f"encoder.layers.{i}."
            qkv = tuple(getattr(at, n).weight.detach() for n in ("q_proj", "k_proj", "v_proj"))
            gu = (mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach())
            if self.fused:
                qkv = (packed[pre + "qkv"] if pre + "qkv" in packed else torch.cat(qkv, 0),)
                gu = (packed[pre + "gate_up"] if pre + "gate_up" in packed else torch.cat(gu, 0),)
            self.layers.append(LayerWeights(norm(layer.input_layernorm.weight), qkv,
                                            packed.get(pre + "self_attn.o_proj.weight", at.o_proj.weight.detach()),
                                            norm(layer.post_attention_layernorm.weight), gu,
                                            packed.get(pre + "mlp.down_proj.weight", mlp.down_proj.weight.detach())))
        self.norm = enc.norm.weight.detach().to(self.act)
        self.head = packed.get("diffusion_head.weight", model.diffusion_head.weight.detach())
        self.devices = [layer.ln1.device for layer in self.layers]
        self.grids = model_grids(model, self.head_dim, self.beta, self.orig_max, self.att_factor) if self.exact else None
        self.rope = RopeTables(self.inv_freq, self.att_factor, self.beta, self.orig_max, self.dtype, self.grids)
        self.steps = ExactSteps(self) if self.exact else FloatSteps(self)
        self._block = None  # (`kernels.layer.block_weights` or None,), made at first use

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
                       lora_rows: slice | None = None, tail: tuple | None = None, *, end: int | None = None):
        """The decoder layers and final norm over embeddings h [R, q, H] of `tokens` ([q] or [R, q])
        at `positions` ([R, q] or [q]), each below `end` (a Python int; None reads it from `positions`,
        a sync the trainer may pay and a round does not). The draft LoRA (`lora`) adds its deltas
        and mask embedding on query columns `lora_rows` of every row.

        `attend(i, dev, q, k, v)` writes layer i's K/V and returns their attention: in the float
        formats of q, k, v [R, heads, q, D] after RoPE -> [R, heads, q, D]; in the exact formats q,
        k, v are None and `fused=` holds them on their grids (`attention.py`) as one tensor
        [R, q, heads, D] -> [R, q, heads x D]. One with a `block` attribute may run every layer in
        one C call (`_one_call`).

        `tail` (exact formats only): (embeddings [m, H], positions [m]) of more query rows run in
        the same matmuls (a prompt's chunk joining a round); `attend` then gets the fused heads
        flat ([R q + m, heads, D]) and returns [R q + m, heads x D], and the result is (final
        states [R, q, H], the tail's [m, H])."""
        R, q, H = h.shape
        pos = positions.reshape(-1, q).expand(R, q).reshape(-1)
        if end is None:
            end = int(pos.max()) + 1
        if lora is None or lora_rows is None:
            lora = None
        else:
            h = lora.embed(tokens, h, lora_rows)
        if tail is not None and not self.exact:
            raise ValueError("a tail of rows runs in the exact formats' layer body only")
        out = None
        if self.exact and tail is None:
            out = self._one_call(h, pos, end, attend, lora, lora_rows)
        return out if out is not None else self._layers(h, pos, end, attend, lora, lora_rows, tail)

    def _layers(self, h: torch.Tensor, pos: torch.Tensor, end: int, attend, lora, lora_rows, tail):
        """The layer body, every format's: the residual stream h [M, H] in `self.act` (updated in place
        in the exact formats), the matmuls on `self.dtype`, the steps between them `self.steps`'."""
        st, layers, devices = self.steps, self.layers, self.devices
        R, q, H = h.shape
        M0, heads = R * q, self.n_heads + 2 * self.n_kv
        h = st.stream(h, M0)
        if tail is not None:  # rows are independent outside the attention: the tail's ride in the same matmuls
            h = torch.cat([h, tail[0].to(h.dtype)])
            pos = torch.cat([pos, tail[1].reshape(-1).to(pos.device)])
        M = h.shape[0]
        shape = Shape(R, q, M, (M, heads, self.head_dim) if tail is not None else (R, q, heads, self.head_dim))
        rows = lora_rows if lora is None or not self.exact else draft_rows(R, q, lora_rows)  # exact: flat rows
        tables, x, last = {}, None, len(layers) - 1
        for i, w in enumerate(layers):
            dev = devices[i]
            if h.device != dev:  # a model split over devices: the stream moves, the norm is redone there
                h, x = h.to(dev), None
            if dev not in tables:
                tables[dev] = st.tables(self.rope, pos, end, dev, shape)
            if x is None:
                x = st.norm(h, w.ln1)
            qkv = (matmul(x, w.qkv[0]),) if len(w.qkv) == 1 else tuple(matmul(x, p) for p in w.qkv)
            if lora is not None:
                qkv = st.lora(lora, i, 0, x, qkv, rows, shape)
            a = st.attention(i, dev, qkv, tables[dev], attend, shape)
            o = (matmul(a, w.wo),)
            if lora is not None:
                o = st.lora(lora, i, 1, a, o, rows, shape)
            h, x = st.add_norm(h, o[0], w.ln2)
            gu = (matmul(x, w.gate_up[0]),) if len(w.gate_up) == 1 else tuple(matmul(x, p) for p in w.gate_up)
            if lora is not None:
                gu = st.lora(lora, i, 2, x, gu, rows, shape)
            m = st.gate(gu)
            d = (matmul(m, w.down),)
            if lora is not None:
                d = st.lora(lora, i, 3, m, d, rows, shape)
            if i < last:
                h, x = st.add_norm(h, d[0], layers[i + 1].ln1.to(dev))
            else:
                h, x = st.final(h, d[0], self.norm.to(dev))
        return x[:M0].view(R, q, H) if tail is None else (x[:M0].view(R, q, H), x[M0:])

    def one_call(self) -> bool:
        """Whether narrow rounds run all their layers in one C call (`kernels.layer.run_block`): w4a8 weights
        on a CPU with the kernels built."""
        if self._block is None:
            cpu = self.exact and all(d.type == "cpu" for d in self.devices) and kl.block_available()
            self._block = (kl.block_weights(self.layers, self.norm, self.grids) if cpu else None,)
        return self._block[0] is not None

    def prepare_lora(self, lora) -> None:
        """Make a draft LoRA's tables now (the one-call block's where it runs, else the layer
        body's), not in the first round that drafts, whose probe it made cost several times its
        prediction and its ledger charge a lost bet."""
        if lora is None:
            return
        if self.one_call():
            lora.block_args(len(self.layers), 1, 1, slice(0, None))
        else:
            lora.prepare(self.devices, exact=self.exact)

    def _one_call(self, h: torch.Tensor, pos: torch.Tensor, end: int, attend, lora=None, lora_rows=None):
        """Every layer in one C call (`kernels.layer.run_block`) where it runs: w4a8 weights on a CPU, a compact
        cache and a round the one-call attention takes (`attend.block`: its cache rows and mask),
        with a draft LoRA too (`DraftLoRA.block_args`); the same kernels in the same order as
        `_layers` with `ExactSteps`, so the same bits -> the final states [R, q, H]. None elsewhere
        (nothing written)."""
        if getattr(attend, "block", None) is None or not self.one_call():
            return None
        (R, q, H), (cache, row, starts, mask) = h.shape, attend.block(self.devices[0])
        if not (h.is_cpu and getattr(cache, "block16", False)):
            return None
        lora_args = None
        if lora is not None and lora.enabled:
            lora_args = lora.block_args(len(self.layers), R, q, lora_rows)
        tab = self.rope.full(end, self.devices[0])
        out = kl.run_block(self._block[0], h.reshape(R * q, H).to(torch.float32, copy=True), pos.contiguous(), tab,
                           R, q, self.n_heads, self.n_kv, self.head_dim, cache, row, starts, mask,
                           2.0 ** self.grids[0].v, self.eps, lora_args)
        return None if out is None else out.view(R, q, H)

    def split_heads(self, xs: torch.Tensor) -> tuple:
        """q, k, v [R, heads, q, D] (views) of the fused heads xs [R, q, nh + 2 kv, D]."""
        return tuple(t.transpose(1, 2) for t in xs.split((self.n_heads, self.n_kv, self.n_kv), 2))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on the rows that are read (hidden [n, H] -> [n, V])."""
        dev = self.head.device if isinstance(self.head, torch.Tensor) else self.devices[-1]
        return matmul(hidden.to(dev, self.dtype), self.head)


# -- the steps between the matmuls, per kind of format -----------------------------------------------
class ExactSteps:
    """The exact formats' steps (bf16 on a CPU, int8, int4, w4a8): `kernels.layer`'s C calls (the
    same bits from their torch twins) on rows flattened to [M, ...]: RMSNorm into bf16, RoPE onto
    the attention grids, the residual added in place with the next norm, the MLP's gate."""

    def __init__(self, ff: FastForward):
        self.eps, self.nh, self.nkv, self.vscale = ff.eps, ff.n_heads, ff.n_kv, 2.0 ** ff.grids[0].v
        H, D = ff.embed.shape[1], ff.head_dim
        self.cols = ((ff.n_heads * D, ff.n_kv * D, ff.n_kv * D), (H,), None, (H,))  # per LoRA group; gate|up's halves

    def stream(self, h, M):
        return h.reshape(M, -1).to(torch.float32, copy=True)

    def tables(self, rope, pos, end, dev, shape):
        return pos.to(dev), rope.full(end, dev)

    def norm(self, h, w):
        return kl.rms(h, w, self.eps)

    def add_norm(self, h, d, w):
        return h, kl.add_rms(h, d, w, self.eps)

    def final(self, h, d, w):
        return h, kl.add_rms(h, d, w, self.eps, out_dtype=torch.float32)

    def attention(self, i, dev, qkv, tab, attend, shape):
        xs = kl.rope(qkv[0], tab[0], tab[1], self.nh, self.nkv, self.vscale)
        return attend(i, dev, None, None, None, fused=xs.view(shape.fused)).reshape(shape.M, -1)

    def gate(self, gu):
        return kl.silu_mul(*gu[0].chunk(2, -1))

    def lora(self, lora, i, g, x, outs, rows, shape):  # in place, module by module (the tail has none)
        out = outs[0]
        lora.add_fused(i, GROUPS[g], x, out, rows, self.cols[g] or (out.shape[-1] // 2,) * 2)
        return outs


class FloatSteps:
    """The float formats' steps (fp32, bf16 or fp16 on a GPU; the draft-LoRA trainer): torch ops,
    out of place (a trainer's gradients need every input kept)."""

    def __init__(self, ff: FastForward):
        self.eps, self.D = ff.eps, ff.head_dim
        self.widths = ((ff.n_heads * ff.head_dim, ff.n_kv * ff.head_dim, ff.n_kv * ff.head_dim), None, 2, None)
        self.act = ff.act  # plain values only: the model frees its forward without the cyclic collector

    def stream(self, h, M):
        return h.reshape(M, -1).to(self.act)

    def tables(self, rope, pos, end, dev, shape):
        p = pos.to(dev)
        return Rope(*(t[p].view(shape.R, 1, shape.q, -1) for t in rope.full(end, dev)))

    def norm(self, h, w):
        return _rms(h, w, self.eps)

    def add_norm(self, h, d, w):
        h = h + d
        return h, _rms(h, w, self.eps)

    final = add_norm

    def attention(self, i, dev, qkv, tab, attend, shape):
        D, (R, q) = self.D, shape[:2]
        qs, ks, vs = (t.view(R, q, -1, D).transpose(1, 2) for t in self._split(0, qkv))
        qs = qs * tab.q_cos + qs.roll(D // 2, -1) * tab.q_sin
        ks = ks * tab.k_cos + ks.roll(D // 2, -1) * tab.k_sin
        return attend(i, dev, qs, ks, vs).transpose(1, 2).reshape(shape.M, -1)

    def gate(self, gu):
        g, u = self._split(2, gu)
        return F.silu(g) * u

    def lora(self, lora, i, g, x, outs, rows, shape):
        """The runtime's LoRA adds in place into (views of) the fused output; a trainer's returns new tensors."""
        R, q = shape[:2]
        outs = lora.add_deltas(i, GROUPS[g], x.view(R, q, -1), tuple(o.view(R, q, -1) for o in self._split(g, outs)),
                               rows)
        return tuple(o.reshape(shape.M, -1) for o in outs)

    def _split(self, g, outs):
        """One fused output as its modules' (views), or the modules' own outputs."""
        if len(outs) > 1:
            return outs
        n = self.widths[g]
        return outs[0].chunk(n, -1) if isinstance(n, int) else outs[0].split(n, -1) if n else outs


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


_FP_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


_ENGINE_LOCK = threading.Lock()


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
