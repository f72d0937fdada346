"""Resident memory of a batch: B rows x N tokens each, against the KV cache's own size plus weights.

    python benchmarks/batch_memory.py [--rows 16] [--tokens 1000] [--model smollm2-135m-instruct]

Greedy AR, eos off, so every row reaches N tokens (prompt + generated). Reports one JSON line:
peak RSS of the process (`ru_maxrss`), the RSS after importing torch and selfspec (the
interpreter's own share, before any model), the model's parameter bytes, the KV cache's bytes
(`BatchForward.cache_bytes`) and the ratios peak / (weights + KV) and (peak - runtime) / (weights + KV).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from memory_growth import rss_mib  # this folder's scripts run with it on sys.path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)

    import torch

    import selfspec
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.batch_forward import BatchForward
    from selfspec.engine.options import DecodeConfig
    from selfspec.engine.request import row_capacity

    if a.threads:
        torch.set_num_threads(a.threads)
    runtime = rss_mib()
    model, tok = selfspec.load(a.model, draft_lora=False) if a.model else selfspec.load(draft_lora=False)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    loaded = rss_mib()
    topics = ["lists", "dicts", "files", "classes", "tests", "strings", "sorting", "recursion", "sets", "loops",
              "generators", "decorators", "exceptions", "modules", "typing", "threads"]
    prompts = [tok.encode(f"# A long tutorial on Python {topics[i % len(topics)]}, part {i}\n") for i in range(a.rows)]
    cfg = DecodeConfig(mode="ar", max_new_tokens=a.tokens - max(len(p) for p in prompts))
    dec = Decoder(model, prompts, cfg, batch_size=a.rows, eos_token_id=[])
    kv = BatchForward.of(model).cache_bytes(a.rows, row_capacity(prompts, cfg)) / 2**20
    t0 = time.perf_counter()
    n = sum(len(chunk) for _, chunk in dec)
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows": a.rows, "tokens_per_row": a.tokens, "new_tokens": n, "seconds": round(dt, 1),
                      "rss_runtime_mib": round(runtime, 1), "rss_after_load_mib": round(loaded, 1),
                      "rss_peak_mib": round(peak, 1), "weights_mib": round(weights, 1), "kv_cache_mib": round(kv, 1),
                      "peak_over_weights_plus_kv": round(peak / (weights + kv), 3),
                      "peak_minus_runtime_over_weights_plus_kv": round((peak - runtime) / (weights + kv), 3),
                      "threads": torch.get_num_threads()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
