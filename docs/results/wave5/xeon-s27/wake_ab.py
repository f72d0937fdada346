# run from the checkout root with a patch (not kept): Planner._shadow_ended sets dormant = 0 (ends a rest) when a chain opened by a forecast came true whole, if planner.WAKE; arms AR, WAKE False (as shipped), True. "long": the long suite's ~1k tune prompts, whole requests
import sys, time
from collections import Counter
from selfspec.engine import planner as P
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts, read_suite
kind, temp, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
model, tok = load(progress=False)
if kind == "long":
    prompts = [p for p in read_suite("long") if p["length"] == "1k" and p["split"] == "tune"]; tokens = 96
else:
    prompts = [p for p in read_prompts("benchmarks/tune_prompts.jsonl") if kind == "all" or kind in p["id"]][:8]; tokens = 128
enc = [encode_prompt(tok, p["prompt"]) for p in prompts]
arms = ["ar", "nowake", "wake"]
stored = {a: {} for a in arms}
sec, hist = Counter(), {a: Counter() for a in arms}
for rep in range(reps + 1):
    for i, ids in enumerate(enc):
        k = (i + rep) % len(arms)
        for arm in arms[k:] + arms[:k]:
            P.WAKE = arm == "wake"
            model.__dict__["_selfspec_planners"] = stored[arm]
            d = Decoder(model, [ids], DecodeConfig(mode="ar" if arm == "ar" else "auto", max_new_tokens=tokens, temperature=temp), seeds=[i], **({"eos_token_id": []} if kind == "long" else {}))
            t0 = time.perf_counter()
            for _ in d: pass
            if rep: sec[arm] += time.perf_counter() - t0; hist[arm] += Counter(d.stats[0].plan_hist)
print(kind, temp, {a: f"{sec[a]:.2f}s {sec['ar']/sec[a]:.3f}x" for a in arms}, flush=True)
for a in arms[1:]: print(" ", a, dict(hist[a].most_common(5)))
