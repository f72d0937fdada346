"""python docs/results/wave5/xeon-s30/outside.py T REPEATS [prof]
auto vs ar: a generation's wall split into step() calls (round + observe), prefill calls, and the rest."""
import sys, time, collections, os, cProfile, pstats
import selfspec.engine.step as step_mod
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
T = float(sys.argv[1]); reps = int(sys.argv[2]); prof = len(sys.argv) > 3
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
acc = collections.defaultdict(float); cnt = collections.Counter()
mode = ["?"]
def wrap(name):
    real = getattr(step_mod.Stepper, name)
    def f(self, *a, **k):
        t0 = time.perf_counter(); out = real(self, *a, **k); dt = time.perf_counter() - t0
        acc[(mode[0], name)] += dt; cnt[(mode[0], name)] += 1
        if name == "step":
            acc[(mode[0], "round")] += out.seconds
            if self.planner is not None: pass
        return out
    setattr(step_mod.Stepper, name, f)
for n in ("step", "prefill", "prefill_rest", "prefill_chunk"): wrap(n)
pr = cProfile.Profile()
for rep in range(reps):
    for m in (("ar", "auto") if rep % 2 == 0 else ("auto", "ar")):
        mode[0] = m
        for ids in enc:
            g = __import__("torch").Generator().manual_seed(rep)
            t0 = time.perf_counter()
            if prof and m == "auto": pr.enable()
            for _ in Decoder(model, [ids], DecodeConfig(mode=m, max_new_tokens=128, temperature=T), generators=[g]):
                pass
            if prof and m == "auto": pr.disable()
            acc[(m, "wall")] += time.perf_counter() - t0
for m in ("ar", "auto"):
    w = acc[(m, "wall")]; st = acc[(m, "step")]; rd = acc[(m, "round")]
    pf = sum(acc[(m, n)] for n in ("prefill", "prefill_rest", "prefill_chunk"))
    n = cnt[(m, "step")]
    print(f"{m:5s} wall {w:.3f} s  rounds {n}  round {rd:.3f}  step-round (observe) {(st-rd)/n*1e6:.1f} us/round  prefill {pf:.3f}  rest {(w-st-pf)/n*1e6:.1f} us/round")
if prof:
    pstats.Stats(pr).sort_stats("tottime").print_stats(25); pstats.Stats(pr).sort_stats("cumtime").print_stats("planner|decoder|ledger|choice|lookup|streaming|per_sequence|sequence|shadow|calib|round_costs|cost", 40)
