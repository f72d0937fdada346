"""Answer from a long input with the one-byte KV cache (`kv_cache_dtype="int8"`, the default model's
default in its default format, w4a8): half the bytes per cached token of the int16 cache, faster
decoding at long contexts, a little quality.

    python examples/long_context_int8_cache.py                       # a ~3,000-token file from the long suite
    python examples/long_context_int8_cache.py --file notes.txt --kv-cache-dtype int16

Streams the continuation and prints the cache's bytes per token, the time to the first token and
the decode speed after it. The default input is the first ~3,000-token prompt of the shipped long
suite (CPython's source and docs, PSF licence).
"""

import argparse
import time

import selfspec
from selfspec.engine.forward.batch_forward import BatchForward
from selfspec.tools.bench_prompts import read_suite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--file", default=None, help="a text file to continue (default: the long suite's 3k prompt)")
    ap.add_argument("--kv-cache-dtype", default="int8", choices=["int16", "int8"])
    ap.add_argument("--max-new-tokens", type=int, default=96)
    a = ap.parse_args()
    model, tok = selfspec.load(kv_cache_dtype=a.kv_cache_dtype)
    if a.file:
        with open(a.file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = next(p["prompt"] for p in read_suite("long") if p["length"] == "3k")
    gen = selfspec.stream(model, tok, prompt, max_new_tokens=a.max_new_tokens)
    t0, first = time.perf_counter(), None
    for delta in gen:
        first = first or time.perf_counter()
        print(delta, end="", flush=True)
    end = time.perf_counter()
    s = gen.stats
    per_token = BatchForward.of(model).cache_bytes(1, 1)
    print(f"\n-- {a.kv_cache_dtype} cache: {per_token:,} bytes a cached token; first token after "
          f"{first - t0:.2f} s, then {(s.new_tokens - 1) / (end - first):.0f} tok/s; layouts {dict(s.plan_hist)}")


if __name__ == "__main__":
    main()
