"""Resident memory growth over a long generation, per mode (shipped model, CPU).

    python benchmarks/memory_growth.py [--tokens 1000] [--modes ar lookup linear-one-pass presto-one-pass auto]

Each mode first runs a short warm-up generation (allocator pools, the profile, first-call
caches), then a generation of --tokens new tokens with eos off; the growth is VmRSS after
minus VmRSS before that generation. A leak that scales with the context shows up here.
"""

import argparse
import gc
import json
import os

import torch

import selfspec
from selfspec.engine.options import DecodeConfig
from selfspec.engine.decoder import generate_ids

MODES = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup"),
    "linear-one-pass": dict(mode="linear", schedule="one-pass"),
    "presto-one-pass": dict(mode="presto", schedule="one-pass", budget=32),
    "auto": dict(),
}


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model, tok = selfspec.load()
    ids = tok.encode("import os\nimport sys\n\n\ndef main(argv):\n")
    out = {}
    for name in a.modes:
        kw = MODES[name]
        generate_ids(model, ids, DecodeConfig(max_new_tokens=64, **kw), eos_token_id=[])
        gc.collect()
        before = rss_mib()
        gen, st = generate_ids(model, ids, DecodeConfig(max_new_tokens=a.tokens, **kw), eos_token_id=[])
        gc.collect()
        out[name] = {"rss_growth_mib": round(rss_mib() - before, 1), "new_tokens": len(gen),
                     "tokens_per_second": round(st.new_tokens / st.seconds, 1), "tau": round(st.tau, 2)}
        print(name, out[name], flush=True)
    print(json.dumps({"tokens": a.tokens, "rss_before_mib": round(rss_mib(), 1), "modes": out}))


if __name__ == "__main__":
    main()
