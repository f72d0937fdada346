# Session 34 A/B: variants of one decode of the tune prompts of one kind (chat / code / all), B rows at a time,
# 64 tokens, variants in a random order each repeat, one process, each variant with its own planners.
#   python eps_ab.py KIND B REPEATS T VARIANTS      variants: ar, ar2 (A/A), auto, auto-eps<N> (ledger EPS = N/1000)
import collections, random, statistics, sys, time
import selfspec.engine.ledger as ledger_mod
import selfspec.engine.planner as planner_mod
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
kind, B, reps, T, variants = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5].split(",")
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")
       if kind == "all" or kind in p["id"]]
stores, EPS0 = {}, ledger_mod.EPS
def configure(v):
    model.__dict__["_selfspec_planners"] = stores.setdefault(v, {})
    eps = EPS0
    for part in v.split("-")[1:]:
        if part.startswith("eps"):
            eps = int(part[3:]) / 1000
    ledger_mod.EPS = planner_mod.EPS = eps
    return DecodeConfig(mode=v.split("-")[0].rstrip("2"), max_new_tokens=64, temperature=T)
for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)):
    pass
random.seed(1)
wall, toks = collections.defaultdict(list), {}
for _ in range(reps):
    order = variants[:]; random.shuffle(order)
    for v in order:
        cfg = configure(v)
        t0 = time.perf_counter(); out = collections.defaultdict(list)
        for ev in Decoder(model, enc, cfg, batch_size=B, seeds=list(range(len(enc)))):
            pass
        wall[v].append(time.perf_counter() - t0)
ref = wall[variants[0]]
print(f"# {kind}, B = {B}, T = {T}, {reps} repeats in random order")
for v in variants:
    ratios = [a / b for a, b in zip(ref, wall[v])]
    print(f"{v:16s} {sum(wall[v]):7.3f} s  {variants[0]}/this {sum(ref) / sum(wall[v]):.3f}  "
          f"per-repeat median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
