"""Where batched plan "auto" gains and loses: per kind of round, the planner's predicted
tokens and seconds against what the round did, and the run's wall time against batched AR's.

    python benchmarks/batch_rounds.py [--batch-size 8] [--limit 16] [--max-new-tokens 64] [--prompts FILE]

Runs batched AR, then plan "auto", on the same prompts (default: the default model's held-out
prompts, measured here, never tuned on). Prints one JSON object: per layout the rounds, the
mean predicted / actual tokens and milliseconds per round and both rates; the seconds spent in
rounds and outside them (prefills, refills); both runs' wall time and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", default=None, help="JSONL prompts (default: the default model's held-out prompts)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)

    import torch

    import selfspec
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.engine.planner import Planner
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench import read_prompts

    torch.set_num_threads(a.threads)
    model, tok = selfspec.load()
    path = a.prompts or os.path.join(default_model_dir(), "prompts.jsonl")
    prompts = [encode_prompt(tok, p["prompt"]) for p in read_prompts(path)[: a.limit]]
    rounds = defaultdict(lambda: [0, 0.0, 0, 0.0, 0.0])  # rounds, predicted tokens, tokens, predicted s, s
    real_observe = Planner.observe

    def observe(self, rnd):
        if self.predicted is not None:  # resting rounds (AR without a choice) have no prediction
            r = rounds[rnd.layout]
            r[0] += 1
            r[1] += self.predicted[0]
            r[2] += sum(len(x.committed) for x in rnd.rows)
            r[3] += self.predicted[1]
            r[4] += rnd.seconds
        return real_observe(self, rnd)

    Planner.observe = observe
    out = {"command": "python benchmarks/batch_rounds.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "batch_size": a.batch_size, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens}
    for mode in ("ar", "auto"):
        dec = Decoder(model, prompts, DecodeConfig(mode=mode, max_new_tokens=a.max_new_tokens),
                      batch_size=a.batch_size, eos_token_id=[])
        t0 = time.perf_counter()
        n = sum(len(chunk) for _, chunk in dec)
        wall = time.perf_counter() - t0
        out[mode] = {"wall_seconds": round(wall, 2), "tokens_per_second": round(n / wall, 1)}
    out["auto_over_ar"] = round(out["auto"]["tokens_per_second"] / out["ar"]["tokens_per_second"], 3)
    in_rounds = sum(r[4] for r in rounds.values())
    out["auto"]["round_seconds"] = round(in_rounds, 2)
    out["auto"]["outside_rounds_seconds"] = round(out["auto"]["wall_seconds"] - in_rounds, 2)
    out["layouts"] = {
        k: {"rounds": n, "tokens_predicted": round(pt / n, 2), "tokens": round(t / n, 2),
            "ms_predicted": round(1e3 * ps / n, 1), "ms": round(1e3 * s / n, 1),
            "rate_predicted": round(pt / ps, 1) if ps else None, "rate": round(t / s, 1)}
        for k, (n, pt, t, ps, s) in sorted(rounds.items(), key=lambda kv: -kv[1][0])}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
