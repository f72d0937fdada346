"""Weight formats on this device: forward cost per width, where a one-token forward's time goes,
and quality against fp32 on the held-out prompts.

    python benchmarks/formats.py [--formats fp32 bf16 int8 int4] [--limit 8] [--tokens 64] [--out FILE]

Per format: the median time of one forward of w query tokens over 256 cached tokens (w = 1, 2,
3, 4, 5, 8, 16), with the head on every row; the share of a one-token forward spent in the weight
matmuls (linear / int8 / int4 kernels, the head included) and in attention, from torch's profiler;
top-1 agreement with fp32 and the mean KL(fp32 || format) per token over fp32's greedy
continuation of each held-out prompt (teacher-forced, `--tokens` tokens); whether a row's logits
are bitwise width-invariant (`engine.formats.invariant`). Prints one JSON object (with the
command) and a Markdown table. Run it alone: timings move with anything else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["fp32", "bf16", "int8", "int4"])
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    import torch

    import selfspec
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine.batch_forward import BatchForward
    from selfspec.engine.decoder import generate_ids
    from selfspec.engine.formats import clone, invariant, set_weights
    from selfspec.engine.options import DecodeConfig
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench import read_prompts

    torch.set_num_threads(2)
    base, tok = selfspec.load(weights="fp32")
    prompts = [encode_prompt(tok, p["prompt"]) for p in read_prompts(os.path.join(default_model_dir(),
                                                                                  "prompts.jsonl"))[: a.limit]]
    # fp32's greedy continuations: the text every format is scored on
    conts = [generate_ids(base, p, DecodeConfig(mode="ar", max_new_tokens=a.tokens), eos_token_id=[])[0]
             for p in prompts]

    def logits(m, p, cont):
        bf = BatchForward.of(m)
        ids = torch.tensor(p + cont[:-1])
        cache = bf.new_cache(1, len(ids) + 1)
        h = bf(ids[None], torch.arange(len(ids))[None], cache, slice(0, 1), causal=True)
        return bf.logits(h[0, len(p) - 1:]).float()

    ref = [logits(base, p, c) for p, c in zip(prompts, conts)]
    report = {"command": "python benchmarks/formats.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "torch": torch.__version__, "formats": {}}
    for fmt in a.formats:
        m = set_weights(clone(base), fmt)
        agree, kl, n = 0.0, 0.0, 0
        for r, p, c in zip(ref, prompts, conts):
            lp, lq = r.log_softmax(-1), logits(m, p, c).log_softmax(-1)
            agree += float((lp.argmax(-1) == lq.argmax(-1)).sum())
            kl += float((lp.exp() * (lp - lq)).sum(-1).sum())
            n += lp.shape[0]
        report["formats"][fmt] = {"agreement": round(agree / n, 4), "kl": round(kl / n, 5),
                                  "invariant": invariant(m), **costs(m), **shares(m)}
        print(fmt, report["formats"][fmt], file=sys.stderr)
    print(table(report))
    print(json.dumps(report))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


WIDTHS = (1, 2, 3, 4, 5, 8, 16)


def _setup(m, cached=256):
    import torch

    from selfspec.engine.batch_forward import BatchForward

    bf = BatchForward.of(m)
    cache = bf.new_cache(1, cached + 20)
    ids = torch.arange(cached) % 1000 + 5
    bf(ids[None], torch.arange(cached)[None], cache, slice(0, 1), causal=True)
    cache.set_length(0, cached)
    return bf, cache


def _forward(bf, cache, w):
    import torch

    block = torch.full((w, w), float("-inf")).triu(1)
    h = bf(torch.arange(w)[None] + 7, torch.arange(w)[None], cache, slice(0, 1), block=block[None] if w > 1 else None)
    bf.logits(h[0])


def costs(m) -> dict:
    """Median ms of a forward of w tokens over 256 cached tokens, per w."""
    bf, cache = _setup(m)
    out = {}
    for w in WIDTHS:
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            _forward(bf, cache, w)
            times.append(time.perf_counter() - t0)
        out[str(w)] = round(1e3 * sorted(times[1:])[3], 2)
    return {"ms": out}


MATMUL = ("aten::linear", "aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")
ATTENTION = ("aten::matmul", "aten::bmm", "aten::scaled_dot_product_attention", "aten::exp_", "aten::amax")


def shares(m) -> dict:
    """Where a one-token forward's time goes (torch profiler, self CPU time of top-level ops)."""
    from torch.profiler import ProfilerActivity, profile

    bf, cache = _setup(m)
    for _ in range(3):
        _forward(bf, cache, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            _forward(bf, cache, 1)
    total = matmul = attention = 0.0
    for e in prof.key_averages():
        total += e.self_cpu_time_total
        if e.key in MATMUL or e.key.startswith("aten::_weight_int"):
            matmul += e.cpu_time_total if e.key == "aten::linear" else 0.0
        if e.key in ("aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu"):
            matmul += e.self_cpu_time_total
        if e.key in ("aten::bmm", "aten::scaled_dot_product_attention"):
            attention += e.cpu_time_total if e.key == "aten::scaled_dot_product_attention" else e.self_cpu_time_total
    return {"weight_matmul_share": round(matmul / total, 3), "attention_matmul_share": round(attention / total, 3),
            "outside_matmuls_share": round(1 - (matmul + attention) / total, 3)}


def table(report: dict) -> str:
    rows = ["| format | top-1 agreement vs fp32 | mean KL | width-invariant | f(1) ms | f(2)/f(1) | f(4)/f(1) "
            "| f(8)/f(1) | weight matmuls | attention matmuls | rest |", "|" + "---|" * 11]
    for fmt, r in report["formats"].items():
        ms = r["ms"]
        rows.append(f"| {fmt} | {r['agreement']:.3f} | {r['kl']:.4f} | {'yes' if r['invariant'] else 'no'} | "
                    f"{ms['1']:.1f} | {ms['2'] / ms['1']:.2f} | {ms['4'] / ms['1']:.2f} | {ms['8'] / ms['1']:.2f} | "
                    f"{r['weight_matmul_share']:.0%} | {r['attention_matmul_share']:.0%} | {r['outside_matmuls_share']:.0%} |")
    return "\n".join(rows)


if __name__ == "__main__":
    raise SystemExit(main())
