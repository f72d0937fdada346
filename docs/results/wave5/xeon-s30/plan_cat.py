"""Planner Python per round by what the round was (bare, forecast -> choice), auto on the tune prompts.
    python docs/results/wave5/xeon-s30/plan_cat.py T REPEATS [ID_SUBSTRING]"""
import sys, time, collections
import selfspec.engine.planner as P
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
T = float(sys.argv[1]); reps = int(sys.argv[2]); kind = sys.argv[3] if len(sys.argv) > 3 else ""
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl") if kind in p["id"]]
acc = collections.defaultdict(float); cnt = collections.Counter()
real_plan, real_obs = P.Planner.plan, P.Planner.observe
def plan(self, rnd):
    t0 = time.perf_counter(); o = real_plan(self, rnd); dt = time.perf_counter() - t0
    if rnd.bare: c = "bare"
    else:
        f = rnd.rows[0].forecast
        k = "none" if f is None or f.kind is None else f.kind
        c = f"fc:{k}->{o.family if o.speculative else 'AR' if not o.groups else 'probe'}"
    acc[c] += dt; cnt[c] += 1; rnd._cat = c
    return o
def observe(self, rnd):
    t0 = time.perf_counter(); real_obs(self, rnd); dt = time.perf_counter() - t0
    acc["obs " + rnd._cat] += dt; cnt["obs " + rnd._cat] += 1
P.Planner.plan, P.Planner.observe = plan, observe
for rep in range(reps):
    for ids in enc:
        g = __import__("torch").Generator().manual_seed(rep)
        for _ in Decoder(model, [ids], DecodeConfig(mode="auto", max_new_tokens=128, temperature=T), generators=[g]):
            pass
for k in sorted(acc):
    print(f"{k:28s} n {cnt[k]:6d} mean {acc[k]/cnt[k]*1e6:8.1f} us total {acc[k]*1e3:8.1f} ms")
