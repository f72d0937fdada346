"""Planner Python (plan + observe) a round by kind, auto over the 16 tune prompts B rows at a time.
    python docs/results/wave5/xeon-s30/plan_batch.py B T REPEATS"""
import sys, time, collections
import selfspec.engine.planner as P
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B, T, reps = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
acc = collections.defaultdict(float); cnt = collections.Counter()
real_plan, real_obs = P.Planner.plan, P.Planner.observe
def plan(self, rnd):
    t0 = time.perf_counter(); o = real_plan(self, rnd); dt = time.perf_counter() - t0
    c = "bare" if rnd.bare else ("fc->" + (o.family if o.speculative else "probe" if o.groups else "AR"))
    acc["plan " + c] += dt; cnt["plan " + c] += 1; rnd._cat = c
    return o
def observe(self, rnd):
    t0 = time.perf_counter(); real_obs(self, rnd); dt = time.perf_counter() - t0
    acc["obs " + rnd._cat] += dt; cnt["obs " + rnd._cat] += 1
P.Planner.plan, P.Planner.observe = plan, observe
wall = 0.0
for rep in range(reps):
    t0 = time.perf_counter()
    for _ in Decoder(model, enc, DecodeConfig(mode="auto", max_new_tokens=64, temperature=T), batch_size=B,
                     seeds=list(range(len(enc)))):
        pass
    wall += time.perf_counter() - t0
rounds = sum(v for k, v in cnt.items() if k.startswith("plan "))
for k in sorted(acc):
    print(f"{k:20s} n {cnt[k]:6d} mean {acc[k]/cnt[k]*1e6:8.1f} us total {acc[k]*1e3:8.1f} ms")
tot = sum(acc.values())
print(f"planner {tot*1e3:.1f} ms of {wall*1e3:.0f} ms wall ({tot/wall*100:.1f}%), {rounds} rounds, {wall/rounds*1e3:.2f} ms a round")
