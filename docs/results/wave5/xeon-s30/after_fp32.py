"""Does a run of ours right after an fp32-weights run (the bench's --compare-weights row) go slower than one
after a run of ours? AR on the 16 tune prompts, 32 tokens; the timed run follows either an fp32 AR run of the same
prompts or an untimed AR run of ours, alternating.
    python docs/results/wave5/xeon-s30/after_fp32.py REPEATS"""
import sys, time
import selfspec
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
reps = int(sys.argv[1])
model, tok = selfspec.load(progress=False)
fp32 = selfspec.load(weights="fp32", progress=False)[0]
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
cfg = DecodeConfig(mode="ar", max_new_tokens=32)
def run(m, ids):
    t0 = time.perf_counter(); n = 0
    d = Decoder(m, [ids], cfg)
    for _ in d: pass
    return time.perf_counter() - t0, len(d.outputs[0])
acc = {"after fp32": [0.0, 0], "after ours": [0.0, 0]}
for r in range(reps):
    for before in (("fp32", "ours") if r % 2 == 0 else ("ours", "fp32")):
        for ids in enc:
            run(fp32 if before == "fp32" else model, ids)
            dt, n = run(model, ids)
            a = acc["after " + before]; a[0] += dt; a[1] += n
for k, (s, n) in acc.items():
    print(f"{k}: {n / s:.1f} tok/s ({n} tokens)")
print(f"after fp32 / after ours: {(acc['after fp32'][1] / acc['after fp32'][0]) / (acc['after ours'][1] / acc['after ours'][0]):.3f}")
