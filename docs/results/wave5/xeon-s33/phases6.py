# Session 33: phases5.py plus "arspinN": AR with an N-microsecond Python spin before each round's plan.
import sys, time, collections
import selfspec.engine.step as S
import selfspec.engine.planner as P
from selfspec.engine.layouts import AR
real_plan, real_obs = P.Planner.plan, P.Planner.observe
def bare_plan(self, rnd):
    self.predicted = None; rnd.bare = True; return AR
import selfspec.engine.batch_forward as BF
import selfspec.engine.targets as TG
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B, T, path, reps = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
VARIANTS = sys.argv[5].split(","); STORES = {}
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts(path)][:16]
acc = collections.defaultdict(float)
cur = [None]
pc = time.perf_counter
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t0 = pc(); r = f(*a, **k); dt = pc() - t0; acc[(cur[0], key)] += dt
        if key == "bf": acc[(cur[0], key + tag[0])] += dt
        return r
    setattr(cls, name, g)
wrap(S.Stepper, "step", "step")
SPIN = [0.0]
_plan = S.Stepper.plan
def plan_spin(self, rnd):
    if SPIN[0]:
        t0 = pc()
        x = 0
        while pc() - t0 < SPIN[0]:
            x += 1
    return _plan(self, rnd)
S.Stepper.plan = plan_spin
wrap(S.Stepper, "plan", "plan")
wrap(S.Stepper, "draft", "draft")
tag = [""]
_fw = S.Stepper.forward
def fw(self, rnd, *a, **k):
    tag[0] = "/ar" if self.planner is None else ("/bare" if rnd.bare else ("/spec" if rnd.option.speculative else "/fc"))
    acc[(cur[0], "n" + tag[0])] += 1
    try:
        r = _fw(self, rnd, *a, **k)
        acc[(cur[0], "njoin_tokens")] += rnd.join_tokens
        acc[(cur[0], "ncache_len")] += rnd.cache_len
        acc[(cur[0], "nwidth")] += rnd.width
        return r
    finally:
        tag[0] = "/pre"
S.Stepper.forward = fw
wrap(S.Stepper, "forward", "forward")
wrap(S.Stepper, "verify_commit", "verify")
wrap(BF.BatchForward, "__call__", "bf")
wrap(BF.BatchForward, "logits", "logits")
wrap(S.Stepper, "targets_of", "targets")
wrap(S.Stepper, "prefill_chunk", "own chunk")
wrap(S.Stepper, "prefill", "prefill")
for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)): pass
import random
random.seed(0)
for rep in range(reps):
    order = VARIANTS[:]; random.shuffle(order)
    for mode in order:
        cur[0] = mode
        stub = "stub" in mode
        model.__dict__["_selfspec_planners"] = STORES.setdefault(mode, {})
        P.Planner.plan = bare_plan if stub else real_plan
        SPIN[0] = int(mode.split("spin")[1]) * 1e-6 if "spin" in mode else 0.0
        P.Planner.observe = (lambda self, rnd: None) if stub else real_obs
        kw = dict(lookup=False, rho="none", draft_lora=False) if "off" in mode else {}
        d = Decoder(model, enc, DecodeConfig(mode=mode.split("-")[0].rstrip("2").split("spin")[0], max_new_tokens=64, temperature=T, **kw), batch_size=B, seeds=list(range(16)))
        t0 = pc()
        for _ in d: pass
        acc[(mode, "wall")] += pc() - t0
keys = sorted({k for _, k in acc})
print("per pass (ms; n: rounds)", VARIANTS)
for k in keys:
    vals = [acc[(v, k)] / reps * (1 if k.startswith("n") else 1e3) for v in VARIANTS]
    print(f"{k:10s} " + "  ".join(f"{x:9.2f}" for x in vals))
