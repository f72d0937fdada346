"""Command line: `python -m selfspec generate ...`, `python -m selfspec bench ...` and `python -m selfspec trace ...`."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--block-length", type=int, default=16, help="draft block / mask-group length B")
    p.add_argument("--group-size", type=int, default=None, help="one-pass mask-group size (default B)")
    p.add_argument("--group-nodes", type=int, default=None, help="one-pass: nodes that get a group (default all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--sample-top-k", type=int, default=0, help="sampling top-k (0 = off)")
    p.add_argument("--top-k", type=int, default=4, help="PRESTO candidates per depth")
    p.add_argument("--lam", type=float, default=0.2, help="PRESTO lambda")
    p.add_argument("--rho", default="ngram", choices=["none", "ngram", "learned"])
    p.add_argument("--no-draft-lora", action="store_true", help="ignore the checkpoint's linear_spec_lora adapter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default cpu)")
    p.add_argument("--device-map", default=None, help="accelerate device map, e.g. auto (spreads layers over GPUs)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: fp32 on CPU, bf16 on CUDA)")


def _decode_kwargs(a) -> dict:
    return dict(mode=a.mode, schedule=a.schedule, block_length=a.block_length, group_size=a.group_size, group_nodes=a.group_nodes,
                max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.sample_top_k,
                budget=a.budget, tree_top_k=a.top_k, lam=a.lam, rho=a.rho, draft_lora=not a.no_draft_lora)


def cmd_generate(a) -> int:
    from .config import DecodeConfig
    from .model import load
    from .streaming import stream

    DecodeConfig(**_decode_kwargs(a))  # bad options fail before the model loads
    if a.prompt_file is not None:
        if not os.path.isfile(a.prompt_file):
            raise SystemExit(f"error: prompt file {a.prompt_file} not found")
        with open(a.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = a.prompt
    if not prompt:
        raise SystemExit("error: empty prompt")
    model, tok = load(a.model, dtype=a.dtype, device=a.device, device_map=a.device_map)
    gen = stream(model, tok, prompt, seed=a.seed, stop=a.stop or None, **_decode_kwargs(a))
    for delta in gen:
        if not a.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    s = gen.stats.as_dict()
    if a.json:
        rec = {"text": gen.text, "token_ids": gen.token_ids, **s, "mode": a.mode,
               "schedule": None if a.mode == "ar" else a.schedule, "block_length": a.block_length,
               "temperature": a.temperature, "finish_reason": gen.finish_reason}
        if a.mode == "presto":
            rec.update(budget=a.budget, rho=a.rho, lam=a.lam, top_k=a.top_k)
        print(json.dumps(rec))
    else:
        sys.stdout.write("\n")
        print(f"[{a.mode}/{a.schedule if a.mode != 'ar' else '-'}] {s['new_tokens']} tokens, {s['rounds']} rounds, "
              f"tau {s['tau']:.2f}, TPF {s['tpf']:.2f}, {s['tokens_per_second']:.1f} tok/s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m selfspec", description="Self-speculative decoding with diffusion LMs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a continuation of a prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON record instead of streaming text")
    g.add_argument("--mode", default="presto", choices=["ar", "linear", "presto"])
    g.add_argument("--schedule", default="one-pass", choices=["two-pass", "one-pass"])
    g.add_argument("--budget", type=int, default=32, help="PRESTO draft-node budget")
    _add_common_args(g)
    g.set_defaults(func=cmd_generate)
    from .bench import add_bench_parser

    add_bench_parser(sub, _add_common_args)
    from .trace import add_trace_parser

    add_trace_parser(sub, _add_common_args)
    a = ap.parse_args(argv)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
