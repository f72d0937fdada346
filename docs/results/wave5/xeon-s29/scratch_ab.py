"""AR mode with its own cache scratch (1 slot) against auto's (the same rows' capacity as auto): model time a round,
alternating in one process. python scratch_ab.py PROMPTS_FILE REPEATS"""
import sys, time, collections
import selfspec.engine.request as req
import selfspec.engine.step as step_mod
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
import importlib
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts(sys.argv[1])]
real_scratch = req.scratch
auto_cfg = DecodeConfig(mode="auto")
mods = [m for m in list(sys.modules.values()) if m and getattr(m, "__name__", "").startswith("selfspec") and getattr(m, "scratch", None) is real_scratch]
def set_scratch(big):
    f = (lambda cfg: real_scratch(auto_cfg)) if big else real_scratch
    for m in mods: m.scratch = f
acc = collections.defaultdict(list)
real_timed = step_mod.Stepper.timed
label = ["?"]
def timed(self, seqs, fn, rnd=None):
    t0 = time.perf_counter(); out = real_timed(self, seqs, fn, rnd)
    if rnd is not None: acc[label[0]].append(time.perf_counter() - t0)
    return out
step_mod.Stepper.timed = timed
print("patched modules:", [m.__name__ for m in mods])
for rep in range(int(sys.argv[2])):
    for big in ((False, True) if rep % 2 == 0 else (True, False)):
        set_scratch(big); label[0] = "auto-size" if big else "ar-size"
        for ids in enc:
            for _ in Decoder(model, [ids], DecodeConfig(mode="ar", max_new_tokens=128, temperature=0)):
                pass
for k, v in acc.items():
    print(k, len(v), "mean model call %.1f us" % (sum(v) / len(v) * 1e6))
