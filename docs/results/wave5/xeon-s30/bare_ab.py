"""python docs/results/wave5/xeon-s30/bare_ab.py B REPEATS T [VARIANTS: ar,ar-cap,ar2,auto,auto-bare,auto-stub]
B rows: AR mode vs auto whose planner always returns a bare AR round (its Python still runs observe/settle)
vs auto with plan AND observe stubbed out; model ms a round, alternating."""
import sys, time, collections, os
import selfspec.engine.step as step_mod
import selfspec.engine.planner as P
from selfspec.engine.layouts import AR
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B = int(sys.argv[1]); reps = int(sys.argv[2]); T = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
acc = collections.defaultdict(list); wall = collections.Counter()
real_step = step_mod.Stepper.step
label = ["?"]
def step(self, *a, **k):
    rnd = real_step(self, *a, **k)
    acc[label[0]].append((rnd.seconds, rnd.model_seconds))
    return rnd
step_mod.Stepper.step = step
real_plan, real_obs = P.Planner.plan, P.Planner.observe
def bare_plan(self, rnd):
    self.predicted = None; rnd.bare = True; return AR
import selfspec.engine.request as req
real_scratch = req.scratch
mods = [m for m in list(sys.modules.values()) if m and getattr(m, "__name__", "").startswith("selfspec") and getattr(m, "scratch", None) is real_scratch]
auto_cfg = DecodeConfig(mode="auto")
def set_scratch(big):
    f = (lambda cfg: real_scratch(auto_cfg)) if big else real_scratch
    for m in mods: m.scratch = f
variants = sys.argv[4].split(",") if len(sys.argv) > 4 else ["ar", "auto", "auto-bare", "auto-stub"]
for rep in range(reps):
    for v in (variants if rep % 2 == 0 else variants[::-1]):
        P.Planner.plan = real_plan if v == "auto" else bare_plan
        P.Planner.observe = (lambda self, rnd: None) if v == "auto-stub" else real_obs
        label[0] = v
        set_scratch(v == "ar-cap")
        t0 = time.perf_counter()
        for _ in Decoder(model, enc, DecodeConfig(mode=v.rstrip("0123456789").split("-")[0], max_new_tokens=64, temperature=T), batch_size=B,
                         seeds=list(range(len(enc)))):
            pass
        wall[v] += time.perf_counter() - t0
for k in variants:
    v = acc[k]
    print(f"{k:10s} rounds {len(v)} round {sum(x[0] for x in v)/len(v)*1e3:.3f} ms model {sum(x[1] for x in v)/len(v)*1e3:.3f} ms wall {wall[k]:.2f} s  ar/this {wall['ar']/wall[k]:.3f}")
