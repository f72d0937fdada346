# run from the checkout root with a patch (not kept): planner.plan counts a forecast round with nothing to offer (choice.nothing_to_offer) as IDLE_WEIGHT AR choices towards a rest (note_choice(option, weight)); arms AR, IDLE_WEIGHT 1 (as shipped), 2, 4
import sys, time
from collections import Counter
from selfspec.engine import planner as P
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
kind, temp, reps = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
model, tok = load(progress=False)
prompts = [p for p in read_prompts("benchmarks/tune_prompts.jsonl") if kind == "all" or kind in p["id"]][:8]
enc = [encode_prompt(tok, p["prompt"]) for p in prompts]
arms = ["ar", "idle1", "idle2", "idle4"]
stored = {a: {} for a in arms}
sec, hist = Counter(), {a: Counter() for a in arms}
for rep in range(reps + 1):
    for i, ids in enumerate(enc):
        k = (i + rep) % len(arms)
        for arm in arms[k:] + arms[:k]:
            if arm != "ar": P.IDLE_WEIGHT = int(arm[4:])
            model.__dict__["_selfspec_planners"] = stored[arm]
            d = Decoder(model, [ids], DecodeConfig(mode="ar" if arm == "ar" else "auto", max_new_tokens=128, temperature=temp), seeds=[i])
            t0 = time.perf_counter()
            for _ in d: pass
            if rep: sec[arm] += time.perf_counter() - t0; hist[arm] += Counter(d.stats[0].plan_hist)
print(kind, temp, {a: f"{sec[a]:.2f}s {sec['ar']/sec[a]:.3f}x" for a in arms}, flush=True)
for a in arms[1:]: print(" ", a, dict(hist[a].most_common(5)))
