# Session 33: phases.py with a third variant, AR with auto's cache capacity ("ar-cap").
import sys, time, collections
import selfspec.engine.step as S
import selfspec.engine.planner as P
import selfspec.engine.batch_forward as BF
import selfspec.engine.targets as TG
import selfspec.engine.decoder as DM
real_cap = DM.row_capacity
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B, T, path, reps = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts(path)][:16]
acc = collections.defaultdict(float)
cur = [None]
pc = time.perf_counter
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t0 = pc(); r = f(*a, **k); acc[(cur[0], key)] += pc() - t0; return r
    setattr(cls, name, g)
wrap(S.Stepper, "step", "step")
wrap(S.Stepper, "plan", "plan")
wrap(S.Stepper, "draft", "draft")
wrap(S.Stepper, "forward", "forward")
wrap(S.Stepper, "verify_commit", "verify")
wrap(BF.BatchForward, "__call__", "bf")
wrap(BF.BatchForward, "logits", "logits")
wrap(S.Stepper, "targets_of", "targets")
wrap(P.Planner, "observe", "p.observe")
wrap(S.Stepper, "prefill_chunk", "own chunk")
wrap(S.Stepper, "prefill", "prefill")
for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)): pass
import random
random.seed(0)
for rep in range(reps):
    order = ["ar", "auto", "ar-cap"]; random.shuffle(order)
    for mode in order:
        cur[0] = mode
        DM.row_capacity = (lambda *a, **k: real_cap(*a, **k) + 63) if mode == "ar-cap" else real_cap
        d = Decoder(model, enc, DecodeConfig(mode=mode.split("-")[0], max_new_tokens=64, temperature=T), batch_size=B, seeds=list(range(16)))
        t0 = pc()
        for _ in d: pass
        acc[(mode, "wall")] += pc() - t0
keys = sorted({k for _, k in acc})
for k in keys:
    a, b, c = acc[("ar", k)] / reps * 1e3, acc[("auto", k)] / reps * 1e3, acc[("ar-cap", k)] / reps * 1e3
    print(f"{k:12s} ar {a:9.2f} ms  auto {b:9.2f} ms  diff {b - a:+8.2f}  ar-cap {c:9.2f} diff {c - a:+8.2f}")
