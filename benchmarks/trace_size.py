"""Size of `python -m selfspec trace` pages: 256 new tokens at budget 32, shipped model, held-out prompts.

    python benchmarks/trace_size.py [--limit 8] [--max-new-tokens 256] [--budget 32]

Prints one line per (prompt, schedule) and a final JSON summary (largest page in bytes).
Greedy, so the numbers are reproducible; the prompts are models/pystdlib-nld-9m/prompts.jsonl.
"""

import argparse
import json
import os

import torch

import selfspec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--budget", type=int, default=32)
    a = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = selfspec.load()
    with open(os.path.join(selfspec.default_model_dir(), "prompts.jsonl"), encoding="utf-8") as f:
        prompts = [json.loads(line) for line in f][: a.limit]
    sizes = []
    for p in prompts:
        for schedule in ("one-pass", "two-pass"):
            gen = selfspec.generate(model, tok, p["prompt"], max_new_tokens=a.max_new_tokens, budget=a.budget,
                                    schedule=schedule, eos_token_id=[], trace=True)
            size = len(gen.trace.to_html().encode("utf-8"))
            nodes = sum(len(r.tokens) for r in gen.trace.rounds)
            sizes.append(size)
            print(f"{p['id']:32s} {schedule:8s} rounds {gen.stats.rounds:4d} nodes {nodes:5d} tau {gen.stats.tau:5.2f} "
                  f"page {size / 1e6:.3f} MB", flush=True)
    print(json.dumps({"pages": len(sizes), "max_bytes": max(sizes), "mean_bytes": round(sum(sizes) / len(sizes)),
                      "max_new_tokens": a.max_new_tokens, "budget": a.budget}))


if __name__ == "__main__":
    main()
