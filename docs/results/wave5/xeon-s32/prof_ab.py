"""cProfile of three passes of mode "ar" and of mode "auto" (planner stubbed with "stub": a bare AR
round every round, nothing learnt), B rows over the 16 tune prompts, 64 tokens; the 25 functions
with the most time of their own.

    python docs/results/wave5/xeon-s32/prof_ab.py B stub"""
import sys, cProfile, pstats, io
import selfspec.engine.planner as P
from selfspec.engine.layouts import AR
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B = int(sys.argv[1]); stub = sys.argv[2] == "stub"
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
if stub:
    def bare_plan(self, rnd):
        self.predicted = None; rnd.bare = True; return AR
    P.Planner.plan = bare_plan; P.Planner.observe = lambda self, rnd: None
for mode in ["ar", "auto"]:
    for _ in Decoder(model, enc, DecodeConfig(mode=mode, max_new_tokens=64), batch_size=B, seeds=list(range(16))): pass
    pr = cProfile.Profile()
    pr.enable()
    for rep in range(3):
        for _ in Decoder(model, enc, DecodeConfig(mode=mode, max_new_tokens=64), batch_size=B, seeds=list(range(16))): pass
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print("=====", mode); print(s.getvalue()[:6000])
