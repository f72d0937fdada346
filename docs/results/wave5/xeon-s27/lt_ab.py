# run from the checkout root: python docs/results/wave5/xeon-s27/lt_ab.py KIND T REPEATS (tune prompts; arms AR, auto with lookup_tokens 10 (default), 16)
import sys, time
from collections import Counter
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts, read_suite
kind, temp, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
model, tok = load(progress=False)
if kind.startswith("long"):
    prompts = [p for p in read_suite("long") if p["length"] == "1k" and p["split"] == "tune"]
else:
    prompts = [p for p in read_prompts("benchmarks/tune_prompts.jsonl") if kind == "all" or kind in p["id"]][:8]
enc = [encode_prompt(tok, p["prompt"]) for p in prompts]
arms = ["ar", "lt10", "lt16"]
stored = {a: {} for a in arms}
sec, hist = Counter(), {a: Counter() for a in arms}
for rep in range(reps + 1):
    for i, ids in enumerate(enc):
        k = (i + rep) % len(arms)
        for arm in arms[k:] + arms[:k]:
            model.__dict__["_selfspec_planners"] = stored[arm]
            cfg = DecodeConfig(mode="ar", max_new_tokens=128, temperature=temp) if arm == "ar" else DecodeConfig(max_new_tokens=128, temperature=temp, lookup_tokens=int(arm[2:]))
            d = Decoder(model, [ids], cfg, seeds=[i])
            t0 = time.perf_counter()
            for _ in d: pass
            if rep: sec[arm] += time.perf_counter() - t0; hist[arm] += Counter(d.stats[0].plan_hist)
print(kind, temp, {a: f"{sec[a]:.2f}s {sec['ar']/sec[a]:.3f}x" for a in arms}, flush=True)
for a in arms[1:]: print(a, dict(hist[a].most_common(6)))
