import sys, json
sys.path.insert(0, "benchmarks")
import long_prompt_join as lpj
from selfspec.engine import step as stepmod
new = stepmod.Stepper.share_prefixes
import selfspec
from selfspec.engine.options import DecodeConfig
model, tok = selfspec.load(progress=False)
import os
pool = lpj.texts(os.path.join(model.name_or_path, "prompts.jsonl"))
P, S = int(sys.argv[1]), int(sys.argv[2])
shorts = [tok.encode(pool[i % len(pool)]) for i in range(4)]
ids, i = [], 4
while len(ids) < P:
    ids += tok.encode(pool[i % len(pool)] + "\n\n"); i += 1
long = ids[:P]
shorts[0] = long[:S] + tok.encode("\n\nWhat is the first sentence about?")
for mode in ("ar", "auto"):
    cfg = DecodeConfig(max_new_tokens=8 + P + 64, **({"mode": "ar"} if mode == "ar" else {}))
    for rep in range(2):
        for way in (("old", "new") if rep == 0 else ("new", "old")):
            stepmod.Stepper.share_prefixes = new if way == "new" else (lambda self, *a: None)
            r = lpj.run(model, cfg, shorts, long, chunk=None, warmup=8, tokens=16, join=True)
            print(mode, way, "ttft_ms", r["ttft_ms"], "prefill_forwards", r["prefill_forwards"], "during p95", r["during_prefill"]["p95_ms"], "gaps p50", r["gaps"]["p50_ms"], flush=True)
