"""Lookup bets: predicted (tokens, seconds) against what the round committed and took, by prompt kind; tune prompts,
one shared planner (as a server or the bench), T=0, 128 tokens. Also the AR-type rounds after them (wake)."""
import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))  # the checkout
import sys, time, collections
import selfspec.engine.step as step_mod
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from auto_rounds import kind as round_kind
T = float(sys.argv[1]); reps = int(sys.argv[2])
model, tok = load(None, progress=False)
ps = read_prompts(os.path.join(ROOT, "benchmarks/tune_prompts.jsonl"))
cur = {"k": None, "since": 99, "w": 0}
st = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
real_step = step_mod.Stepper.step
def step(self, *a, **kw):
    rnd = real_step(self, *a, **kw)
    if self.planner is None:
        e = st[cur["k"], "AR mode"]; e[0] += 1; e[2] += rnd.seconds; e[4] += rnd.model_seconds; return rnd
    k = round_kind(rnd)
    pred = self.planner.predicted
    if k in ("bare", "fc-ar"):
        cur["since"] += 1
        key = (cur["k"], f"{k} +{cur['since']}" if cur["since"] <= 3 else k)
    else:
        cur["since"] = 0
        key = (cur["k"], k + (" w<=4" if rnd.width <= 4 else " w5-8" if rnd.width <= 8 else " w9+"))
    e = st[key]; e[0] += 1
    e[1] += sum(len(r.committed) for r in rnd.rows); e[2] += rnd.seconds; e[4] += rnd.model_seconds
    if pred is not None and k not in ("bare",):
        e[3] += pred[0]
        e.append(pred[1])
    return rnd
step_mod.Stepper.step = step
for r in range(reps):
    for i, p in enumerate(ps):
        cur["k"] = "code" if "code" in p["id"] else "chat"
        ids = encode_prompt(tok, p.get("prompt") or p["messages"])
        for mode in ("ar", "auto"):
            for _ in Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=128, temperature=T), seeds=[i]):
                pass
for key in sorted(st, key=str):
    e = st[key]; n = e[0]
    ps_ = e[5:]
    print(f"{key[0]:5s} {key[1]:14s} n {n:5d} ms {e[2]/n*1e3:6.3f} model {e[4]/n*1e3:6.3f} tokens {e[1]/n:5.2f}"
          + (f" | predicted tokens {e[3]/len(ps_):5.2f} seconds {sum(ps_)/len(ps_)*1e3:6.3f}" if ps_ else ""))
