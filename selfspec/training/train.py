"""Train a small NLD-architecture model with the joint AR + diffusion objective.

    python -m selfspec.training.train --out models/stdlib-nld-9m --minutes 60

Corpus: the interpreter's standard library (selfspec.training.data; held-out files never seen).
Objective (docs/training.md): the doubled sequence [x_t | x_0] with the block mask of
`masks.joint_training_allowed`; each noisy block is, at random, fully masked (the one-pass
inference pattern), clean-first-then-masked (the two-pass pattern [seed, M...]) or masked at a
random ratio; block offsets vary per step so drafts can start anywhere. Loss = AR CE on x_0 +
`diff_weight` * diffusion CE on the masked slots of x_t.
Checkpoints (model, optimizer, step, RNG) go to --run-dir every --save-every steps and on exit;
rerunning the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from selfspec.checkpoint.config import NemotronLabsDiffusionConfig
from selfspec.training.data import split_corpus
from selfspec.engine.forward.masks import additive, joint_training_allowed
from selfspec.checkpoint.model import NemotronLabsDiffusionModel
from selfspec.checkpoint.tokenizer import SPECIALS, SentencePieceTokenizer, train_sentencepiece


def model_config(vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> NemotronLabsDiffusionConfig:
    return NemotronLabsDiffusionConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 1024,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1,
        },
        bos_token_id=SPECIALS["bos"],
        eos_token_id=SPECIALS["eos"],
        pad_token_id=SPECIALS["pad"],
        mask_token_id=SPECIALS["mask"],
        block_size=16,
        tie_word_embeddings=False,
        architectures=["NemotronLabsDiffusionModel"],
    )


def noise_block_types(batch: int, n: int, block: int, offset: int, gen: torch.Generator, p_full: float, p_seed: float):
    """Which noisy slots are masked: [batch, n] bool, per block full / seed-clean / random ratio."""
    i = torch.arange(n)
    blk = (i + offset) // block
    nblk = int(blk[-1]) + 1
    kind = torch.rand(batch, nblk, generator=gen)
    ratio = torch.rand(batch, nblk, generator=gen) * (1 - 1e-3) + 1e-3
    first = (i == 0) | ((i + offset) % block == 0)
    full = kind < p_full
    seed = (kind >= p_full) & (kind < p_full + p_seed)
    rand = torch.rand(batch, n, generator=gen) < ratio[:, blk]
    masked = torch.where(full[:, blk], True, torch.where(seed[:, blk], ~first, rand))
    return masked


def joint_loss(model, x0: torch.Tensor, masked: torch.Tensor, attn: torch.Tensor, mask_id: int, diff_weight: float):
    b, n = x0.shape
    xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
    pos = torch.cat([torch.arange(n), torch.arange(n)]).unsqueeze(0)
    hidden = model.encoder(input_ids=torch.cat([xt, x0], 1), attention_mask=attn, position_ids=pos).last_hidden_state
    noisy, clean = hidden[:, :n], hidden[:, n:]
    ar_logits = model.diffusion_head(clean[:, :-1]).float()
    l_ar = F.cross_entropy(ar_logits.reshape(-1, ar_logits.shape[-1]), x0[:, 1:].reshape(-1))
    d_logits = model.diffusion_head(noisy[masked]).float()
    l_diff = F.cross_entropy(d_logits, x0[masked]) if d_logits.shape[0] else torch.zeros(())
    return l_ar + diff_weight * l_diff, l_ar.detach(), l_diff.detach()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def encode_corpus(tok, texts, cache_path: str | None) -> torch.Tensor:
    if cache_path and os.path.isfile(cache_path):
        return torch.load(cache_path)
    ids = []
    for text in texts:
        ids.extend(tok.encode(text))
        ids.append(tok.eos_token_id)
    data = torch.tensor(ids, dtype=torch.int16 if len(tok) < 32768 else torch.int32)
    if cache_path:
        torch.save(data, cache_path)
    return data


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m selfspec.training.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="where the final checkpoint is written")
    ap.add_argument("--run-dir", default=None, help="resumable state (default runs/<out name>)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--minutes", type=float, default=None, help="stop (and save) after this much training time")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--diff-weight", type=float, default=1.0)
    ap.add_argument("--p-full", type=float, default=0.45)
    ap.add_argument("--p-seed", type=float, default=0.35)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--save-every", type=int, default=200)
    ap.add_argument("--max-files", type=int, default=None, help="train on the first N files only (smoke tests)")
    ap.add_argument("--no-bf16", action="store_true", help="train in fp32 instead of bf16 autocast")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = args.run_dir or os.path.join("runs", os.path.basename(os.path.normpath(args.out)))
    os.makedirs(run_dir, exist_ok=True)
    torch.manual_seed(args.seed)

    train_files, held = split_corpus()
    if args.max_files:
        train_files = train_files[: args.max_files]
    texts = [t for _, t in train_files]
    sp_path = os.path.join(run_dir, "tokenizer.model")
    if not os.path.isfile(sp_path):
        train_sentencepiece(texts, os.path.join(run_dir, "tokenizer"), vocab_size=args.vocab, seed=args.seed)
    tok = SentencePieceTokenizer(sp_path)
    data = encode_corpus(tok, texts, os.path.join(run_dir, "train_ids.pt"))

    cfg = model_config(len(tok), args.hidden, args.layers, args.heads, args.kv_heads, args.ffn)
    cfg.block_size = args.block
    model = NemotronLabsDiffusionModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    state_path = os.path.join(run_dir, "state.pt")
    step, elapsed, log = 0, 0.0, []
    if os.path.isfile(state_path):
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        gen.set_state(st["gen"])
        step, elapsed, log = st["step"], st["elapsed"], st["log"]

    def save():
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(), "step": step,
                    "elapsed": elapsed, "log": log, "args": vars(args)}, state_path + ".tmp")
        os.replace(state_path + ".tmp", state_path)

    n, b = args.seq_len, args.block
    masks = {o: additive(joint_training_allowed(n, b, o))[None, None] for o in range(b)}
    nparams = sum(p.numel() for p in model.parameters())
    bar = tqdm(total=args.steps, initial=step, desc=f"train {nparams / 1e6:.1f}M", dynamic_ncols=True)
    model.train()
    ema = None
    while step < args.steps and (args.minutes is None or elapsed < args.minutes * 60):
        t0 = time.perf_counter()
        starts = torch.randint(0, len(data) - n - 1, (args.batch,), generator=gen)
        x0 = torch.stack([data[s : s + n] for s in starts.tolist()]).long()
        offset = int(torch.randint(0, b, (1,), generator=gen))
        masked = noise_block_types(args.batch, n, b, offset, gen, args.p_full, args.p_seed)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16):
            loss, l_ar, l_diff = joint_loss(model, x0, masked, masks[offset], cfg.mask_token_id, args.diff_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        dt = time.perf_counter() - t0
        elapsed += dt
        step += 1
        rec = (float(l_ar), float(l_diff))
        ema = rec if ema is None else tuple(0.98 * e + 0.02 * r for e, r in zip(ema, rec))
        log.append({"step": step, "ar": rec[0], "diff": rec[1], "sec": round(elapsed, 2)})
        bar.set_postfix(ar=f"{ema[0]:.3f}", diff=f"{ema[1]:.3f}", tok_s=f"{args.batch * n / dt:.0f}")
        bar.update(1)
        if step % args.save_every == 0:
            save()
    bar.close()
    save()
    model.eval()
    cfg.dtype = "bfloat16"
    model.to(torch.bfloat16).save_pretrained(args.out)
    tok.save_pretrained(args.out)
    summary = {"steps": step, "train_seconds": round(elapsed, 1), "params": nparams, "tokens_seen": step * args.batch * n,
               "final_ar_loss_ema": ema and round(ema[0], 4), "final_diff_loss_ema": ema and round(ema[1], 4),
               "train_files": len(train_files), "held_out_files": len(held), "args": vars(args)}
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
