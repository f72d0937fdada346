"""Rounds of `auto` by kind on the long suite's tune half at one length (priors by match length and 2 AR rounds of
funds at each start, so that it bets: `tune_runs.patch_planner("new+funds")`): measured round seconds (median; the
model's share; the planner's), the cost model's prediction for its width, committed tokens.
    python docs/results/wave5/xeon-s31/round_kinds.py 1k|3k"""
import os, statistics, sys
import selfspec
from selfspec.engine.cost import cost_model
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_suite
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_runs  # noqa: E402

tune_runs.patch_planner("new+funds")
model, tok = selfspec.load(progress=False)
rows = tune_runs.round_log(cost_model(model))
ps = [p for p in read_suite("long") if p["split"] == "tune" and p["length"] == sys.argv[1]]
for rep in range(2):
    for p in ps:
        for _ in Decoder(model, [encode_prompt(tok, p["prompt"])], DecodeConfig(mode="auto", max_new_tokens=96),
                         eos_token_id=[]):
            pass
for k, v in sorted(rows.items()):
    md = lambda i: statistics.median(x[i] for x in v) * 1e3  # noqa: E731
    print(f"{k:14s} n {len(v):4d} round {md(0):6.2f} ms model {md(1):6.2f} plan {md(2):5.2f} cost-model {md(4):6.2f} "
          f"committed mean {statistics.mean(x[3] for x in v):.2f}")
