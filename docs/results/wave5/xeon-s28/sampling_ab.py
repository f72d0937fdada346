"""AR generations at T = 1 (reproducible sampling), timed whole: run it from two checkouts in turn
(this session's start and its end), alternating, and compare. Run from a checkout's root:

    PYTHONPATH=. python docs/results/wave5/xeon-s28/sampling_ab.py LABEL OUT.json

The first 8 / 16 of benchmarks/tune_prompts.jsonl, 64 new tokens, seeds 0..15: B = 1 (8 prompts,
one at a time) and B = 8 (16 prompts, 8 rows at a time); the fastest of 3 repeats of each, the
median time of the targets step (`engine.targets.targets_of`) a round, and the tokens (the same
in both checkouts). Appends one JSON line to OUT.json.
"""
import json
import statistics
import sys
import time

from selfspec.engine import step as step_mod
from selfspec.engine import targets as tg
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts

label, out = sys.argv[1], sys.argv[2]
model, tok = load(progress=False)
enc = [encode_prompt(tok, p["prompt"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")[:16]]
spent = []
real = tg.targets_of


def targets_of(parts, mask_id):
    t0 = time.perf_counter()
    got = real(parts, mask_id)
    spent.append((len(parts), time.perf_counter() - t0))
    return got


step_mod.targets_of = targets_of
record = {"label": label}
for B in (1, 8):
    sets = [[e] for e in enc[:8]] if B == 1 else [enc]
    walls, tokens = [], None
    spent.clear()
    for rep in range(3):
        t0 = time.perf_counter()
        outs = []
        for ids in sets:
            d = Decoder(model, ids, DecodeConfig(mode="ar", max_new_tokens=64, temperature=1.0), batch_size=B,
                        seeds=list(range(len(ids))))
            for _ in d:
                pass
            outs += d.outputs
        walls.append(time.perf_counter() - t0)
        tokens = outs
    record[f"B{B}"] = {"wall_s": round(min(walls), 4), "targets_us": round(statistics.median(
        s for n, s in spent if n == B) * 1e6, 1), "tokens": tokens}
    print(label, B, record[f"B{B}"]["wall_s"], record[f"B{B}"]["targets_us"], flush=True)
with open(out, "a") as f:
    f.write(json.dumps(record) + "\n")
