# run from the checkout root: TREE=<a checkout> python docs/results/wave5/xeon-s30/ar_time.py T MODE REPEATS
"""AR (or MODE) over the tune prompts, 128 tokens, T: whole wall, and the Python outside the C block and head calls."""
import sys, time, os
sys.path.insert(0, os.environ["TREE"])
import selfspec
assert selfspec.__file__.startswith(os.environ["TREE"]), selfspec.__file__
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
T = float(sys.argv[1]); mode = sys.argv[2]; reps = int(sys.argv[3])
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
for ids in enc[:2]:
    for _ in Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=16, temperature=T), seeds=[0]): pass
best = None; toks = 0
for r in range(reps):
    t0 = time.perf_counter(); toks = 0
    for i, ids in enumerate(enc):
        d = Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=128, temperature=T), seeds=[i])
        for _ in d: pass
        toks += len(d.outputs[0])
    dt = time.perf_counter() - t0
    best = dt if best is None else min(best, dt)
print(f"{os.environ['TREE']}: {toks / best:.1f} tok/s (best of {reps})")
