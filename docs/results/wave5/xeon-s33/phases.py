# Session 33: per-phase time of one pass, mode "ar" against "auto" (methods wrapped with a timer), pairs in a random
# order.   python phases.py B T PROMPTS REPEATS
import sys, time, collections
import selfspec.engine.step as S
import selfspec.engine.planner as P
import selfspec.engine.batch_forward as BF
import selfspec.engine.targets as TG
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
    order = ["ar", "auto"]; random.shuffle(order)
    for mode in order:
        cur[0] = mode
        d = Decoder(model, enc, DecodeConfig(mode=mode, max_new_tokens=64, temperature=T), batch_size=B, seeds=list(range(16)))
        t0 = pc()
        for _ in d: pass
        acc[(mode, "wall")] += pc() - t0
keys = sorted({k for _, k in acc})
for k in keys:
    a, b = acc[("ar", k)] / reps * 1e3, acc[("auto", k)] / reps * 1e3
    print(f"{k:12s} ar {a:9.2f} ms  auto {b:9.2f} ms  diff {b - a:+8.2f}")
