"""Rounds of `auto` by kind with oracle+free+norest (`tune_runs.patch_planner`) on the long suite's ~1k tune
prompts, AR and auto alternating: decode wall, each kind's rounds (sum, median, the model's and the planner's
shares) and tokens committed. python docs/results/wave5/xeon-s31/oracle_rounds.py"""
import os, statistics, sys, time
import selfspec
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_suite
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_runs  # noqa: E402

tune_runs.patch_planner("oracle+free+norest")
model, tok = selfspec.load(progress=False)
rows = tune_runs.round_log()
ps = [p for p in read_suite("long") if p["split"] == "tune" and p["length"] == "1k"]
walls = {}
for mode in ("ar", "auto", "ar", "auto"):
    for p in ps:
        dec = Decoder(model, [encode_prompt(tok, p["prompt"])], DecodeConfig(mode=mode, max_new_tokens=96),
                      eos_token_id=[])
        first = None
        for _ in dec:
            first = first or time.perf_counter()
        walls[mode] = walls.get(mode, 0) + time.perf_counter() - first
print({k: round(v, 3) for k, v in walls.items()}, "auto/AR %.3f" % (walls["ar"] / walls["auto"]))
tot = 0
for k, v in sorted(rows.items(), key=lambda kv: -len(kv[1])):
    s = sum(x[0] for x in v)
    tot += s
    print(f"{k:10s} n {len(v):4d} sum {s*1e3:8.1f} ms median {statistics.median(x[0] for x in v)*1e3:6.2f} model "
          f"{statistics.median(x[1] for x in v)*1e3:6.2f} plan {statistics.median(x[2] for x in v)*1e3:5.2f} "
          f"committed {sum(x[3] for x in v)}")
print("rounds' time %.1f ms" % (tot * 1e3))
