"""Self-distillation of a draft LoRA: the model learns to draft what it would say itself.

    python -m selfspec.training.draft_lora_cli train --run-dir runs/draft_lora [--resume] [--minutes M]
    python -m selfspec.training.draft_lora_cli eval --run-dir runs/draft_lora
    python -m selfspec.training.draft_lora_cli export --run-dir runs/draft_lora --out models/smollm2-135m-instruct/linear_spec_lora

Base frozen. Trainable: LoRA (rank 16, alpha 32) on q/k/v/o/gate/up/down of every layer, applied
to draft-block rows only, and the mask token's embedding row on mask rows (init: the
checkpoint's row). Per step: one text window (`draft_data.train_window`); a no-grad causal pass
gives the teacher (the frozen model's next-token distribution at every position) and the clean
K/V per layer; then `blocks` draft blocks at random anchors a, each either B mask rows at a..a+B-1
(the one-pass group) or [x_{a-1}, B-1 masks] (the two-pass block), seeing the clean K/V of the
positions before the block and their own block bidirectionally (one SDPA per layer over
[window K/V ; all blocks' K/V] with a float additive mask). The mask row at p predicts token p:
loss = sum_k w_k KL(teacher_p || draft_p) / sum_k w_k, w_k = exp(-(k-1)/4), k = p - a + 1, the
mask id excluded from both distributions (the runtime bans it).
"""

from __future__ import annotations

import json
import math
import os
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.checkpoint.lora import MASK_EMBEDDING, TARGETS, base_model_hash, module_of, peft_key
from selfspec.engine.forward.forward import FastForward

NEG = float("-inf")


class DraftParams(nn.Module):
    """LoRA A [r, in] / B [out, r] per (layer, target) and the mask embedding [H]; B = 0 at init."""

    def __init__(self, model, r: int = 16, alpha: float = 32.0, targets=TARGETS, seed: int = 0):
        super().__init__()
        self.r, self.alpha, self.scale, self.targets = r, float(alpha), float(alpha) / r, tuple(targets)
        g = torch.Generator().manual_seed(seed)
        self.A, self.B = nn.ParameterDict(), nn.ParameterDict()
        for i, layer in enumerate(model.encoder.layers):
            for name in self.targets:
                lin = module_of(layer, name)
                bound = 1 / math.sqrt(lin.in_features)  # PEFT's kaiming_uniform(a=sqrt(5)) bound
                self.A[f"{i}_{name}"] = nn.Parameter((torch.rand(r, lin.in_features, generator=g) * 2 - 1) * bound)
                self.B[f"{i}_{name}"] = nn.Parameter(torch.zeros(lin.out_features, r))
        emb = model.encoder.embed_tokens.weight
        self.mask_embedding = nn.Parameter(emb[int(model.config.mask_token_id)].detach().float().clone())

    def delta(self, i: int, name: str, x: torch.Tensor) -> torch.Tensor | None:
        key = f"{i}_{name}"
        if key not in self.A:
            return None
        return (x @ self.A[key].T) @ self.B[key].T * self.scale


class Frozen:
    """The base model as the trainer reads it: the runtime's own layer body and weights
    (`engine.forward.FastForward`, a private instance built outside inference mode so that
    gradients reach the LoRA), the embedding, the head and the mask id."""

    def __init__(self, model):
        self.ff = FastForward(model)
        self.mask_id = int(model.config.mask_token_id)
        self.embed = self.ff.embed.detach()
        self.head = self.ff.head.detach()


class TrainLoRA:
    """`DraftParams` in the shape the layer body calls (`checkpoint.lora.DraftLoRA`'s): deltas on
    the given query columns, the trainable mask embedding on mask tokens."""

    enabled = True

    def __init__(self, params: "DraftParams", mask_id: int):
        self.params, self.mask_id = params, mask_id

    def add_fused(self, *args) -> None:  # the exact formats' in-place path: the trainer runs the fp32 body
        return None

    def block_args(self, *args):  # and never the one-call block
        return None

    def add_deltas(self, layer: int, names, x, outs, rows):
        assert rows == slice(0, None), "the trainer's blocks are all draft rows"
        return tuple(o if (d := self.params.delta(layer, n, x)) is None else o + d for n, o in zip(names, outs))

    def add_delta(self, layer: int, x, out, rows):
        return self.add_deltas(layer, ("o_proj",), x, (out,), rows)[0]

    def embed(self, tokens, h, rows):
        is_mask = (tokens.reshape(h.shape[:2]) == self.mask_id)[..., None]
        return torch.where(is_mask, self.params.mask_embedding.to(h.dtype), h)


def run(fz: Frozen, h, positions, *, params=None, ctx=None, mask=None, causal=False, keep_kv=False, tokens=None):
    """Final hidden [q, H] of embeddings h [1, q, H] at `positions`, through the runtime's layer body;
    `ctx`: per-layer (k, v) seen before the new rows (mask [q, c + q] float); `params` adds the LoRA
    (and the mask embedding, on mask `tokens`) on every row."""
    ff, kvs = fz.ff, []

    def attend(i, dev, qs, ks, vs):
        if keep_kv:
            kvs.append((ks, vs))
        if ctx is not None:
            ks, vs = torch.cat([ctx[i][0], ks], 2), torch.cat([ctx[i][1], vs], 2)
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal,
                                              enable_gqa=ff.n_heads != ff.n_kv)

    lora = None if params is None else TrainLoRA(params, fz.mask_id)
    toks = torch.zeros(h.shape[1], dtype=torch.long) if tokens is None else tokens
    out = ff.layers_forward(toks, h, positions, attend, lora, slice(0, None) if lora else None)[0]
    return (out, kvs) if keep_kv else out


@dataclass
class Block:
    a: int  # position of the first mask row (depth 1)
    n_mask: int
    root: bool  # two-pass style: the clean token at a-1 leads the block

    @property
    def start(self):
        return self.a - 1 if self.root else self.a


def sample_blocks(rng: random.Random, T: int, n: int, bmin: int, bmax: int, p_root: float, min_ctx: int = 4):
    out = []
    for _ in range(n):
        B = rng.randint(bmin, bmax)
        root = rng.random() < p_root
        nm = B - 1 if root else B
        lo = max(min_ctx, 1) + (1 if root else 0)
        out.append(Block(rng.randint(lo, T - nm), nm, root))
    return out


def block_batch(window: torch.Tensor, blocks: list[Block], mask_id: int):
    """tokens [N], positions [N], float mask [N, T + N], mask-row index [M], target position [M], depth [M]."""
    T = window.shape[0]
    toks, pos, rows, tgt, depth, spans = [], [], [], [], [], []
    for b in blocks:
        off = len(toks)
        if b.root:
            toks.append(int(window[b.a - 1]))
            pos.append(b.a - 1)
        for k in range(b.n_mask):
            rows.append(len(toks))
            toks.append(mask_id)
            pos.append(b.a + k)
            tgt.append(b.a + k)
            depth.append(k + 1)
        spans.append((off, len(toks), b.start))
    N = len(toks)
    mask = torch.full((N, T + N), NEG)
    for off, end, ctx_end in spans:
        mask[off:end, :ctx_end] = 0
        mask[off:end, T + off:T + end] = 0
    t = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return t(toks), t(pos), mask, t(rows), t(tgt), t(depth)


def _drop(logits, mask_id):
    """Logits without the mask id's column (the runtime never emits it)."""
    if mask_id == logits.shape[-1] - 1:
        return logits[..., :-1]
    return torch.cat([logits[..., :mask_id], logits[..., mask_id + 1:]], -1)


@torch.no_grad()
def clean_pass(fz: Frozen, window: torch.Tensor):
    """(teacher log-probs [T, V-1] (row t: the distribution of token t+1), per-layer clean (k, v))."""
    T = window.shape[0]
    h, kvs = run(fz, F.embedding(window, fz.embed)[None], torch.arange(T), causal=True, keep_kv=True)
    return F.log_softmax(_drop(F.linear(h, fz.head), fz.mask_id), -1), kvs


def block_logits(fz: Frozen, params: DraftParams, batch, kvs, T: int):
    """Draft logits [M, V] of the mask rows of `batch` (block_batch) over the clean K/V `kvs`."""
    toks, pos, mask, rows = batch[:4]
    hid = run(fz, F.embedding(toks, fz.embed)[None], pos, params=params, ctx=kvs, mask=mask, tokens=toks)
    return F.linear(hid[rows], fz.head)


def draft_loss(fz, params, window, blocks, decay: float = 4.0, teacher=None):
    """(loss, stats): depth-weighted KL(teacher || draft) over the mask rows of `blocks`."""
    tlog, kvs = teacher if teacher is not None else clean_pass(fz, window)
    batch = block_batch(window, blocks, fz.mask_id)
    tgt, depth = batch[4], batch[5]
    dlog = F.log_softmax(_drop(block_logits(fz, params, batch, kvs, window.shape[0]), fz.mask_id), -1)
    t = tlog[tgt - 1]
    kl = (t.exp() * (t - dlog)).sum(-1)
    w = torch.exp(-(depth.float() - 1) / decay)
    loss = (w * kl).sum() / w.sum()
    agree = (dlog.argmax(-1) == t.argmax(-1)).float()
    return loss, {"kl": kl.detach(), "agree": agree, "depth": depth, "root": torch.tensor([b.root for b in blocks])}


# -- training state ---------------------------------------------------------------------------------
@dataclass
class Hyper:
    window: int = 256
    blocks: int = 16
    bmin: int = 8
    bmax: int = 16
    p_root: float = 0.5
    p_chat: float = 0.5
    p_greedy: float = 0.0
    lr: float = 2e-3
    emb_lr_mult: float = 0.1
    warmup: int = 20
    clip: float = 1.0
    decay: float = 4.0
    r: int = 16
    alpha: float = 32.0
    seed: int = 0


def make_optimizer(params: DraftParams, hp: Hyper):
    groups = [{"params": list(params.A.values()) + list(params.B.values()), "lr": hp.lr},
              {"params": [params.mask_embedding], "lr": hp.lr * hp.emb_lr_mult}]
    for g in groups:
        g["base_lr"] = g["lr"]
    return torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=0.0)


def train_step(fz, params, opt, hp: Hyper, step: int, window: torch.Tensor, rng: random.Random):
    """One optimizer step on `window` (blocks drawn from `rng`); returns the loss and stats."""
    blocks = sample_blocks(rng, window.shape[0], hp.blocks, hp.bmin, hp.bmax, hp.p_root)
    warm = min(1.0, (step + 1) / max(1, hp.warmup))
    for g in opt.param_groups:
        g["lr"] = g["base_lr"] * warm
    loss, st = draft_loss(fz, params, window, blocks, hp.decay)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(params.parameters(), hp.clip)
    opt.step()
    st["grad_norm"] = gn.item()
    return loss.item(), st


def save_state(path: str, params, opt, hp: Hyper, step: int, counters: dict) -> None:
    """Atomically (tmp + rename): LoRA, optimizer, hyper-parameters, step, RNG, data position."""
    state = {"params": params.state_dict(), "opt": opt.state_dict(), "hyper": hp.__dict__, "step": step,
             "counters": counters, "torch_rng": torch.get_rng_state(), "data_position": {"seed": hp.seed, "step": step}}
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_state(path: str, model):
    state = torch.load(path, map_location="cpu", weights_only=False)
    hp = Hyper(**state["hyper"])
    params = DraftParams(model, hp.r, hp.alpha, seed=hp.seed)
    params.load_state_dict(state["params"])
    opt = make_optimizer(params, hp)
    opt.load_state_dict(state["opt"])
    torch.set_rng_state(state["torch_rng"])
    return params, opt, hp, state["step"], state["counters"]


def export(params: DraftParams, model, out_dir: str, note: str = "", dtype=torch.float32) -> None:
    """`out_dir/adapter_config.json` + `adapter_model.safetensors` (PEFT keys + mask_embedding)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for key, a in params.A.items():
        i, name = key.split("_", 1)
        tensors[peft_key(int(i), name, "A")] = a.detach().to(dtype).contiguous()
        tensors[peft_key(int(i), name, "B")] = params.B[key].detach().to(dtype).contiguous()
    tensors[MASK_EMBEDDING] = params.mask_embedding.detach().to(dtype).contiguous()
    cfg = {"peft_type": "LORA", "r": params.r, "lora_alpha": params.alpha, "target_modules": list(params.targets),
           "lora_dropout": 0.0, "bias": "none", "base_model_hash": base_model_hash(model),
           "selfspec_draft_rows_only": True, "mask_embedding": MASK_EMBEDDING,
           "note": note or "selfspec.training.draft_lora: self-distilled draft LoRA (docs/training.md)"}
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors.tmp"))
    os.replace(os.path.join(out_dir, "adapter_model.safetensors.tmp"), os.path.join(out_dir, "adapter_model.safetensors"))
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
