# Session 34: B = 1 on the 16 tune prompts, 64 tokens: time inside the planner's pieces and the round's steps (wrappers).
#   python planner_pieces.py T REPEATS MODE
import sys, time, collections
import selfspec.engine.planner as P, selfspec.engine.choice as C, selfspec.engine.step as S
import selfspec.engine.sequence as SQ
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
T, reps, MODE = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
acc = collections.defaultdict(float); cnt = collections.Counter()
pc = time.perf_counter
depth = [0]
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = pc(); r = f(*a, **k); acc[key] += pc() - t0; cnt[key] += 1; return r
    setattr(obj, name, g)
wrap(P.Planner, "plan", "plan")
wrap(P.Planner, "observe", "observe")
wrap(P.Planner, "settle", "settle")
wrap(P.Planner, "forecast", "forecast")
wrap(P, "nothing_to_offer", "nothing_to_offer")
wrap(P, "plain", "plain")
wrap(P.Planner, "choose", "choose")
wrap(P.Planner, "_shadow", "_shadow")
wrap(P.Planner, "_follow", "_follow")
wrap(S.Stepper, "step", "step")
wrap(S.Stepper, "forward", "forward")
wrap(S.Stepper, "draft", "draft")
wrap(S.Stepper, "verify_commit", "verify")
for _ in Decoder(model, enc[:1], DecodeConfig(mode="auto", max_new_tokens=4)): pass
acc.clear(); cnt.clear()
t0 = pc()
for rep in range(reps):
    for e in enc:
        for _ in Decoder(model, [e], DecodeConfig(mode=MODE, max_new_tokens=64, temperature=T)): pass
wall = pc() - t0
print(f"T={T} reps={reps} wall {wall:.2f}s rounds {cnt['step']}")
for k in sorted(acc, key=lambda k: -acc[k]):
    print(f"{k:18s} {acc[k]*1e3:9.1f} ms  n={cnt[k]:6d}  per {acc[k]/max(cnt[k],1)*1e6:8.1f} us  share {acc[k]/wall*100:5.2f}%")
