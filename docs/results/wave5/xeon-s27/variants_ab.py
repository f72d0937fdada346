"""Planner variants tried in the twenty-seventh session, each against AR and the shipped planner in
one process: every arm keeps its own planner across the prompts, the arms run in rotating order per
prompt, and the first pass is a warm-up that is not counted. Run from the checkout's root:

    python docs/results/wave5/xeon-s27/variants_ab.py VARIANT KIND T REPEATS

VARIANT: rest (REST_MAX 32 / 128), lt (lookup_tokens 10 / 16), and, with their patch from
not_kept.patch applied, sample (BARE_SAMPLE 4 / 1), idle (IDLE_WEIGHT 1 / 2 / 4), wake (WAKE off /
on). KIND: chat, code or all of benchmarks/tune_prompts.jsonl (the first 8; 128 new tokens), or
long (the long suite's ~1k tune prompts, 96 tokens, eos off, whole requests). Prints each arm's
seconds and its ratio to AR, then each speculative arm's plan histogram.
"""
import sys
import time
from collections import Counter

from selfspec.engine import planner as P
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts, read_suite


def setter(name):
    return lambda value: setattr(P, name, value)


# variant -> (arms: name -> value, what sets the value; "cfg" arms set DecodeConfig.lookup_tokens)
VARIANTS = {
    "rest": ({"r32": 32, "r128": 128}, setter("REST_MAX")),
    "lt": ({"lt10": 10, "lt16": 16}, "cfg"),
    "sample": ({"sample4": 4, "sample1": 1}, setter("BARE_SAMPLE")),
    "idle": ({"idle1": 1, "idle2": 2, "idle4": 4}, setter("IDLE_WEIGHT")),
    "wake": ({"nowake": False, "wake": True}, setter("WAKE")),
}

variant, kind, temp, reps = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
values, apply = VARIANTS[variant]
model, tok = load(progress=False)
if kind == "long":
    prompts, tokens = [p for p in read_suite("long") if p["length"] == "1k" and p["split"] == "tune"], 96
else:
    prompts = [p for p in read_prompts("benchmarks/tune_prompts.jsonl") if kind == "all" or kind in p["id"]][:8]
    tokens = 128
enc = [encode_prompt(tok, p["prompt"]) for p in prompts]
arms = ["ar", *values]
stored = {a: {} for a in arms}
sec, hist = Counter(), {a: Counter() for a in arms}
for rep in range(reps + 1):
    for i, ids in enumerate(enc):
        k = (i + rep) % len(arms)
        for arm in arms[k:] + arms[:k]:
            model.__dict__["_selfspec_planners"] = stored[arm]
            extra = {}
            if arm != "ar":
                if apply == "cfg":
                    extra["lookup_tokens"] = values[arm]
                else:
                    apply(values[arm])
            cfg = DecodeConfig(mode="ar" if arm == "ar" else "auto", max_new_tokens=tokens, temperature=temp, **extra)
            d = Decoder(model, [ids], cfg, seeds=[i], **({"eos_token_id": []} if kind == "long" else {}))
            t0 = time.perf_counter()
            for _ in d:
                pass
            if rep:
                sec[arm] += time.perf_counter() - t0
                hist[arm] += Counter(d.stats[0].plan_hist)
print(kind, temp, {a: f"{sec[a]:.2f}s {sec['ar'] / sec[a]:.3f}x" for a in arms}, flush=True)
for a in arms[1:]:
    print(" ", a, dict(hist[a].most_common(5)))
