"""Tokens/s of batched decoding vs batch-1 sequential and transformers' batched `generate`.

    python benchmarks/batch.py [--model pystdlib-nld-9m] [--batches 1 4 8 16] [--new 64] [--mode ar]
                               [--schedule two-pass] [--threads N] [--no-hf]

Every row generates exactly --new tokens (eos off), greedy. Rows of selfspec's batch are checked
against its batch-1 run (they must be equal); transformers `generate` runs on the same weights
(`tools.peers.causal_lm`) with left padding, and its agreement with selfspec is reported (left
padding moves positions, so it may differ in near-ties). One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

PROMPTS = [
    "import os\n\ndef list_files(path):\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "import json\n\nwith open('data.json') as f:\n",
    "def is_prime(n):\n",
    "from collections import Counter\n\nwords = text.split()\n",
    "import re\n\npattern = re.compile(",
    "def merge_sort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "for i in range(10):\n",
    "import sys\n\nif __name__ == '__main__':\n",
    "def read_csv(path):\n    import csv\n",
    "try:\n    import numpy as np\nexcept ImportError:\n",
    "def flatten(nested):\n",
    "import itertools\n\npairs = ",
    "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n",
    "import datetime\n\nnow = datetime.datetime.now()\n",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="pystdlib-nld-9m")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--mode", default="ar", choices=["ar", "lookup", "linear", "presto"])
    ap.add_argument("--schedule", default="two-pass", choices=["two-pass", "one-pass"])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)

    import selfspec
    from selfspec.engine.batch import generate_batch_ids
    from selfspec.engine.decoder import generate_ids
    from selfspec.engine.options import DecodeConfig

    model, tok = selfspec.load(a.model)
    prompts = [tok.encode(p) for p in (PROMPTS * ((a.prompts + len(PROMPTS) - 1) // len(PROMPTS)))[: a.prompts]]
    extra = {} if a.mode in ("ar", "lookup") else dict(schedule=a.schedule)
    cfg = DecodeConfig(mode=a.mode, max_new_tokens=a.new, **extra)
    n_tok = a.new * len(prompts)

    def emit(**rec):
        print(json.dumps({"model": a.model, "mode": a.mode, **extra, "prompts": len(prompts), "new": a.new,
                          "threads": torch.get_num_threads(), **rec}), flush=True)

    generate_ids(model, prompts[0], cfg, eos_token_id=[])  # warm-up (tables, allocator)
    t0 = time.perf_counter()
    ref = [generate_ids(model, p, cfg, eos_token_id=[])[0] for p in prompts]
    dt = time.perf_counter() - t0
    emit(engine="selfspec batch-1 sequential", B=1, seconds=round(dt, 3), tokens_per_second=round(n_tok / dt, 1))
    for B in a.batches:
        t0 = time.perf_counter()
        outs, _ = generate_batch_ids(model, prompts, cfg, eos_token_id=[], batch_size=B)
        dt = time.perf_counter() - t0
        emit(engine="selfspec batched", B=B, seconds=round(dt, 3), tokens_per_second=round(n_tok / dt, 1),
             rows_equal_batch1=sum(o == r for o, r in zip(outs, ref)))
    if a.no_hf or a.mode != "ar":
        return 0
    from selfspec.tools.peers import causal_lm

    lm = causal_lm(model)
    pad = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
    for B in a.batches:
        agree, t0 = 0, time.perf_counter()
        for s in range(0, len(prompts), B):
            chunk = prompts[s : s + B]
            L = max(len(p) for p in chunk)
            ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk])
            att = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
            with torch.inference_mode():
                out = lm.generate(input_ids=ids, attention_mask=att, max_new_tokens=a.new, min_new_tokens=a.new,
                                  do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=pad,
                                  suppress_tokens=[int(model.config.mask_token_id)])
            agree += sum(out[i, L:].tolist() == ref[s + i] for i in range(len(chunk)))
        dt = time.perf_counter() - t0
        emit(engine="transformers generate (left padding)", B=B, seconds=round(dt, 3),
             tokens_per_second=round(n_tok / dt, 1), rows_equal_selfspec=agree)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
