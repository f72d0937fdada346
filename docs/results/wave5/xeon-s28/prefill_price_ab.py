"""Prefill groups priced by plan "auto"'s cost model against priced by tokens (`chunks.token_price`),
both under `auto`, alternating in one process: the time in `_prefill_rows` of 16 prompts of a
prompt file, 8 new tokens, B rows at a time, 8 repeats. Run from the checkout's root at 0736abd's
parent (where the cost model priced them):

    python docs/results/wave5/xeon-s28/prefill_price_ab.py benchmarks/tune_prompts.jsonl 8
"""
import time, collections, sys
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.engine import prefill_steps as ps, chunks
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
model, tok = load(None, progress=False)
prompts = read_prompts(sys.argv[1])
enc = [encode_prompt(tok, p["prompt"]) for p in prompts][:16]
B = int(sys.argv[2])
real = chunks.prefill_groups
arm = ["cost"]
ps.prefill_groups = lambda lefts, price: real(lefts, price if arm[0] == "cost" else chunks.token_price)
acc = collections.Counter()
real_rows = ps.PrefillSteps._prefill_rows
def rows(self, *a, **k):
    t0 = time.perf_counter(); out = real_rows(self, *a, **k); acc[arm[0]] += time.perf_counter() - t0; return out
ps.PrefillSteps._prefill_rows = rows
for rep in range(8):
    for a in (("cost", "tokens") if rep % 2 == 0 else ("tokens", "cost")):
        arm[0] = a
        cfg = DecodeConfig(mode="auto", max_new_tokens=8, temperature=0)
        for _ in Decoder(model, enc, cfg, batch_size=B, seeds=list(range(16))): pass
print(sys.argv[1:], {k: round(v, 3) for k, v in acc.items()}, "tokens/cost", round(acc["tokens"] / acc["cost"], 3))
