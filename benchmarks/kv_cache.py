"""The exact formats' two KV caches side by side: int16 (the default) and int8 (the one-byte cache).

    python benchmarks/kv_cache.py                                   # quality, then AR decode speed
    python benchmarks/kv_cache.py --contexts 64 1000 3000 --new 128 --pairs 2 --formats w4a8 int4

Quality: each weight format's top-1 agreement with fp32 and mean KL(fp32 || format) per position,
teacher-forced over the first `--kl-tokens` tokens of the long suite's ~3,000-token prompts (the
cache's rounding enters every position's attention), with each cache. Speed: the default model in
its default format, AR greedy decoding (eos off) after the long suite's first ~3,000-token prompt
cut to each `--contexts` length, the two caches alternated in mirrored pairs in one process (A B,
B A, ...), decode tokens/s after the first token and the time to it, and the bytes a cached token
takes. Prints a Markdown table per part and one JSON record with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

KVS = ("int16", "int8")


def quality(a) -> list[dict]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from long_kl import agreement_kl

    from selfspec.engine.batch_forward import set_kv_cache_dtype
    from selfspec.engine.formats import _logits, clone, set_weights
    from selfspec.loading import load
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_suite

    model, tok = load(weights="fp32", progress=False)
    texts = [encode_prompt(tok, p["prompt"])[: a.kl_tokens] for p in read_suite("long") if p["length"] == "3k"]
    texts = texts[: a.prompts]
    refs = [_logits(model, torch.tensor(ids)).log_softmax(-1) for ids in texts]
    rows = []
    for fmt in a.formats:
        m = set_weights(clone(model), fmt)
        for kv in KVS:
            set_kv_cache_dtype(m, kv)
            rows.append({"weights": fmt, "kv_cache": kv, **agreement_kl(m, texts, refs)})
            print(f"  {fmt} {kv}: agreement {rows[-1]['agreement']:.4f} KL {rows[-1]['kl']:.6f}", file=sys.stderr,
                  flush=True)
    return rows


def speed(a) -> list[dict]:
    from selfspec.engine.batch_forward import BatchForward, set_kv_cache_dtype
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.loading import load
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_suite

    model, tok = load(progress=False)
    text = next(p["prompt"] for p in read_suite("long") if p["length"] == "3k")
    ids_all = encode_prompt(tok, text)
    cfg = DecodeConfig(mode="ar", max_new_tokens=a.new)
    rows = []
    for n in a.contexts:
        if n > len(ids_all):
            raise SystemExit(f"error: the suite's prompt has {len(ids_all)} tokens, fewer than {n}")
        got = {kv: {"tokens": 0, "seconds": 0.0, "ttft_s": [], "ids": None} for kv in KVS}
        for p in range(a.pairs):
            for kv in (KVS if p % 2 == 0 else KVS[::-1]):
                set_kv_cache_dtype(model, kv)
                dec = Decoder(model, [ids_all[:n]], cfg, eos_token_id=[])
                t0, first = time.perf_counter(), None
                for _ in dec:
                    first = first or time.perf_counter()
                end = time.perf_counter()
                r = got[kv]
                r["tokens"] += dec.stats[0].new_tokens - 1
                r["seconds"] += end - first
                r["ttft_s"].append(round(first - t0, 3))
                r["ids"] = r["ids"] or dec.outputs[0]
        same = next((i for i, (x, y) in enumerate(zip(got["int16"]["ids"], got["int8"]["ids"])) if x != y), a.new)
        for kv in KVS:
            set_kv_cache_dtype(model, kv)
            rows.append({"context": n, "kv_cache": kv, "decode_tokens_per_second": round(got[kv]["tokens"] /
                                                                                         got[kv]["seconds"], 1),
                         "ttft_s": got[kv]["ttft_s"], "bytes_per_token": BatchForward.of(model).cache_bytes(1, 1),
                         "tokens_equal_to_int16_before_the_first_difference": same})
            print(f"  {n} {kv}: {rows[-1]['decode_tokens_per_second']} tok/s", file=sys.stderr, flush=True)
    set_kv_cache_dtype(model, "int16")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="*", default=["w4a8", "int4"], help="weight formats for the quality part")
    ap.add_argument("--kl-tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=2, help="the long suite's first N ~3,000-token prompts (quality)")
    ap.add_argument("--contexts", nargs="*", type=int, default=[64, 1000, 3000])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(2)
    q = quality(a) if a.formats else []
    s = speed(a) if a.contexts else []
    if q:
        print("| weights | KV cache | top-1 agreement with fp32 | mean KL(fp32 || format) |\n|---|---|---|---|")
        for r in q:
            print(f"| {r['weights']} | {r['kv_cache']} | {r['agreement']:.4f} | {r['kl']:.6f} |")
    if s:
        print("\n| context | KV cache | bytes / token | AR decode tok/s | first token s | = int16 for |\n|---|---|---|---|---|---|")
        for r in s:
            print(f"| {r['context']} | {r['kv_cache']} | {r['bytes_per_token']} | {r['decode_tokens_per_second']} | "
                  f"{', '.join(str(t) for t in r['ttft_s'])} | {r['tokens_equal_to_int16_before_the_first_difference']} |")
    print(json.dumps({"command": "python benchmarks/kv_cache.py " + " ".join(sys.argv[1:]), "quality": q, "speed": s}))


if __name__ == "__main__":
    main()
