"""Threads sharing one model: outputs against sequential runs, and what concurrency costs.

    python benchmarks/threads.py [--model pystdlib-nld-9m] [--threads 16] [--repeats 3] [--tokens 40]

Every (prompt, mode) job runs once sequentially (the reference), then `--repeats` times on a
pool of `--threads` threads in a shuffled order. Reports how many threaded outputs equal their
sequential run, and the wall time of the threaded pass over the sequential pass (greedy, so
`auto` is reproducible).
"""

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import selfspec

SETTINGS = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup"),
    "linear one-pass": dict(mode="linear", schedule="one-pass"),
    "presto two-pass N=8": dict(mode="presto", schedule="two-pass", budget=8),
    "hybrid one-pass N=32": dict(mode="presto", schedule="one-pass", budget=32, lookup=True),
    "auto": dict(plan="auto"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="pystdlib-nld-9m", help="a model name or checkpoint folder")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    a = ap.parse_args()
    model, tok = selfspec.load(a.model)
    path = os.path.join(selfspec.checkpoint.registry.resolve(a.model), "prompts.jsonl")
    with open(path) as f:
        prompts = [json.loads(line)["prompt"] for line in f][: a.threads]
    jobs = [(i, name) for i in range(len(prompts)) for name in SETTINGS]

    def run(job):
        i, name = job
        return selfspec.generate(model, tok, prompts[i], max_new_tokens=a.tokens, eos_token_id=[],
                                 **SETTINGS[name]).token_ids

    for job in jobs[: len(SETTINGS)]:  # warm-up: profile, first calls
        run(job)
    t0 = time.perf_counter()
    want = {job: run(job) for job in jobs}
    seq = time.perf_counter() - t0
    rows = []
    for r in range(a.repeats):
        order = jobs[:]
        random.Random(r).shuffle(order)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=a.threads) as pool:
            got = dict(zip(order, pool.map(run, order)))
        wall = time.perf_counter() - t0
        equal = {name: sum(got[j] == want[j] for j in jobs if j[1] == name) for name in SETTINGS}
        rows.append({"repeat": r, "wall_s": round(wall, 2), "vs_sequential": round(wall / seq, 3), "equal": equal})
    total = sum(sum(r["equal"].values()) for r in rows)
    print(json.dumps({"threads": a.threads, "jobs": len(jobs), "repeats": a.repeats, "tokens": a.tokens,
                      "sequential_s": round(seq, 2), "rows": rows,
                      "equal_total": f"{total}/{len(jobs) * a.repeats}"}, indent=1))


if __name__ == "__main__":
    main()
