"""Per-round anatomy of auto at B rows: bare / forecast / speculative rounds, plan and observe time."""
import collections, sys, time
import selfspec.engine.planner as P
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B, reps, T = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
st = collections.Counter()
rp, ro = P.Planner.plan, P.Planner.observe
def plan(self, rnd):
    t0 = time.perf_counter(); o = rp(self, rnd); dt = time.perf_counter() - t0
    k = "bare" if rnd.bare else ("spec:" + o.label if o.speculative else "fcAR")
    st[k + " n"] += 1; st[k + " plan_ms"] += dt * 1e3
    return o
def observe(self, rnd):
    t0 = time.perf_counter(); ro(self, rnd); k = "bare" if rnd.bare else "other"; st["observe_ms " + k] += (time.perf_counter() - t0) * 1e3; st["observe n " + k] += 1
P.Planner.plan, P.Planner.observe = plan, observe
for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)):
    pass
import selfspec.engine.step as S
rf = S.Stepper.forward
for cfgmode in ("ar", "auto"):
    t0 = time.perf_counter()
    for _ in range(reps):
        for _ in Decoder(model, enc, DecodeConfig(mode=cfgmode, max_new_tokens=64, temperature=T), batch_size=B, seeds=list(range(len(enc)))):
            pass
    print(cfgmode, f"{(time.perf_counter() - t0) / reps * 1e3:.1f} ms/pass")
for k in sorted(st):
    print(f"{k:40s} {st[k] / reps:10.2f} /pass")
