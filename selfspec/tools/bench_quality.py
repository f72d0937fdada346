"""`python -m selfspec bench quality`: how close each weight format, KV cache and transformers'
own forward stay to the checkpoint's fp32 forward, teacher-forced on the same text.

For each prompt, fp32 AR's greedy continuation (eos off) is the text every row is scored on; a row
reports top-1 agreement with fp32 and the mean KL(fp32 || row) per position. `--kv-cache` adds
each exact format with its int8 (one-byte) cache beside its int16 one; `--transformers` adds
transformers' own Llama-family forward on the checkpoint's weights (fidelity: agreement, KL and the
largest |logit difference|). Writes results.json (the bench's header fields and one row each) and
table.md; prints the table.
"""

from __future__ import annotations

import json
import os
import sys
import time

from selfspec.tools.bench_common import check_out, read_rows_prompts, run_info

FORMATS = ("bf16", "int8", "int4", "w4a8")


def teacher_logits(model, ids):
    """A causal forward of `ids` through the runtime's compact forward: one row of logits per token."""
    import torch

    from selfspec.engine.forward.batch_forward import BatchForward

    bf = BatchForward.of(model)
    t = torch.tensor(ids)
    cache = bf.new_cache(1, len(t) + 1)
    h = bf(t[None], torch.arange(len(t))[None], cache, slice(0, 1), causal=True)
    return bf.logits(h[0]).float()


def hf_logits(model, ids):
    """transformers' own forward on the same weights (`peers.causal_lm`), the mask id excluded as ours."""
    import torch

    from selfspec.tools.peers import causal_lm

    with torch.inference_mode():
        out = causal_lm(model)(torch.tensor([ids])).logits[0].float()
    return out[:, : model.config.vocab_size]


def score(ref, got, start: int) -> dict:
    """Agreement, summed KL and the largest |logit difference| over the continuation's positions."""
    lp, lq = ref[start:].log_softmax(-1), got[start:, : ref.shape[-1]].log_softmax(-1)
    n = lp.shape[0]
    return {"positions": n, "agree": float((lp.argmax(-1) == lq.argmax(-1)).sum()),
            "kl_sum": float((lp.exp() * (lp - lq)).sum(-1).sum()),
            "max_abs_logit_diff": float((ref[start:] - got[start:, : ref.shape[-1]]).abs().max())}


def rows_for(a, base, texts) -> list[dict]:
    from selfspec.engine.forward.batch_forward import set_kv_cache_dtype
    from selfspec.engine.measure.formats import clone, set_weights

    refs = [teacher_logits(base, ids) for ids, _ in texts]
    specs = [(f, kv) for f in a.formats for kv in (("int16", "int8") if a.kv_cache else ("int16",))]
    if a.transformers:
        specs.append(("transformers", None))
    rows = []
    for fmt, kv in specs:
        if fmt == "transformers":
            got = [hf_logits(base, ids) for ids, _ in texts]
        else:
            m = set_kv_cache_dtype(set_weights(clone(base), fmt), kv)
            got = [teacher_logits(m, ids) for ids, _ in texts]
        parts = [score(r, g, start) for r, g, (_, start) in zip(refs, got, texts)]
        n = sum(p["positions"] for p in parts)
        rows.append({"label": fmt if kv in (None, "int16") else f"{fmt} [kv {kv}]", "weights": fmt, "kv_cache": kv,
                     "positions": n, "agreement": sum(p["agree"] for p in parts) / n,
                     "kl": sum(p["kl_sum"] for p in parts) / n,
                     "max_abs_logit_diff": max(p["max_abs_logit_diff"] for p in parts)})
        print(f"bench quality: {rows[-1]['label']}: agreement {rows[-1]['agreement']:.4f}, KL {rows[-1]['kl']:.5f}",
              file=sys.stderr)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| row | KV cache | positions | top-1 agreement with fp32 | mean KL(fp32 \\|\\| row) | max \\|logit diff\\| |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['kv_cache'] or '-'} | {r['positions']} | {r['agreement']:.4f} | "
                     f"{r['kl']:.5f} | {r['max_abs_logit_diff']:.3g} |")
    return "\n".join(lines)


def cmd_quality(a) -> int:
    from selfspec.checkpoint.quant import FORMATS as ALL
    from selfspec.engine.schedule.decoder import generate_ids
    from selfspec.engine.request.options import DecodeConfig
    from selfspec.loading import load
    from selfspec.streaming import encode_prompt

    for f in a.formats:
        if f not in ALL or f == "fp32":
            raise ValueError(f"unknown weight format {f!r} for bench quality; expected some of {ALL[1:]} "
                             "(fp32 is the reference)")
    if a.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {a.tokens}")
    prompts, prompts_path = read_rows_prompts(a)
    out = check_out(a.out)
    t0 = time.time()
    base, tok = load(a.model, weights="fp32", kv_cache_dtype="int16", progress=False)
    texts = []
    for p in prompts:
        ids = encode_prompt(tok, p["prompt"])
        cont = generate_ids(base, ids, DecodeConfig(mode="ar", max_new_tokens=a.tokens), eos_token_id=[])[0]
        texts.append((ids + cont[:-1], len(ids) - 1))  # positions predicting the continuation's tokens
    rows = rows_for(a, base, texts)
    text = table(rows)
    print(text)
    result = {**run_info(a, base, prompts_path, len(prompts)), "wall_seconds": round(time.time() - t0, 1),
              "reference": "fp32, int16 KV cache", "rows": rows}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(text + "\n")
    return 0


def add_quality_parser(sub) -> None:
    q = sub.add_parser("quality", help="weight formats, KV caches and transformers against the fp32 forward")
    q.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    q.add_argument("--prompts", default=None, help="JSONL prompt file (default: the model's prompts.jsonl)")
    q.add_argument("--limit", type=int, default=8, help="the first N prompts (default 8; 0 = all)")
    q.add_argument("--tokens", type=int, default=64, help="fp32 greedy tokens scored per prompt (default 64)")
    q.add_argument("--formats", nargs="*", default=list(FORMATS), help="weight formats scored (default all but fp32)")
    q.add_argument("--kv-cache", action="store_true", help="each format with its int8 KV cache too")
    q.add_argument("--transformers", action="store_true",
                   help="transformers' own forward on the checkpoint's fp32 weights (fidelity)")
    q.add_argument("--out", default=None, help="output folder (default bench_out/<time>)")
    q.set_defaults(func=cmd_quality)
