"""B-row batches: the shipped rests against rests up to REST_MAX x rows / 2 (not kept), each arm its own
planners, AR the third arm, rotating; the first pass not counted. Run from the checkout's root:

    python docs/results/wave5/xeon-s28/rest_ab.py KIND T REPEATS B    # KIND: chat, code or all (tune prompts)
"""
import sys, time
from collections import Counter
from selfspec.engine import planner as P
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
kind, temp, reps, B = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model, tok = load(progress=False)
prompts = [p for p in read_prompts("benchmarks/tune_prompts.jsonl") if kind == "all" or kind in p["id"]][:16]
enc = [encode_prompt(tok, p["prompt"]) for p in prompts]
real_note = P.Planner.note_choice
def scaled(self, option):
    rows = getattr(self, "_rows", 1)
    old = P.REST_MAX
    P.REST_MAX = old * max(1, rows // 2)
    try:
        real_note(self, option)
    finally:
        P.REST_MAX = old
real_plan = P.Planner.plan
def plan(self, rnd):
    self._rows = len(rnd.rows); return real_plan(self, rnd)
P.Planner.plan = plan
arms = ["ar", "shipped", "scaled"]
stored = {a: {} for a in arms}
sec = Counter(); outs = {}
for rep in range(reps + 1):
    k = rep % len(arms)
    for arm in arms[k:] + arms[:k]:
        model.__dict__["_selfspec_planners"] = stored[arm]
        P.Planner.note_choice = scaled if arm == "scaled" else real_note
        cfg = DecodeConfig(mode="ar" if arm == "ar" else "auto", max_new_tokens=64, temperature=temp)
        t0 = time.perf_counter()
        d = Decoder(model, enc, cfg, batch_size=B, seeds=list(range(len(enc))))
        for _ in d: pass
        if rep: sec[arm] += time.perf_counter() - t0
        outs.setdefault(arm, d.outputs)
print(kind, temp, B, {a: round(sec[a], 3) for a in arms}, {a: round(sec["ar"] / sec[a], 3) for a in arms[1:]},
      "same" if outs["ar"] == outs["shipped"] == outs["scaled"] or temp > 0 else "DIFFER")
