# Session 34: where auto's ~2% at B = 8 (every round AR) goes. Variants, interleaved, 16 tune prompts, 64 tokens:
#   ar | ar2 (A/A) | ar-capN (AR with N more cache slots a row) | auto | auto-stub (the planner returns a bare AR
#   round every round and learns nothing) | auto-stub-capM (M slots a row fewer) | auto-stub-nolk / -norho /
#   -nolora (no lookup index / n-gram rho / draft LoRA) | auto-stub-off (none of the three).
#   bf: BatchForward.__call__ (the model forward, prefill included)
#   python stub_ab.py B T REPEATS VARIANTS
import collections, random, statistics, sys, time
import selfspec.engine.decoder as decoder_mod
import selfspec.engine.planner as P
import selfspec.engine.batch_forward as BF
from selfspec.engine.decoder import Decoder
from selfspec.engine.layouts import AR
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B, T, reps, variants = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
real_plan, real_obs, real_cap = P.Planner.plan, P.Planner.observe, decoder_mod.row_capacity
def bare_plan(self, rnd):
    self.predicted = None; rnd.bare = True; return AR
pc = time.perf_counter
bf_t, cur = collections.defaultdict(float), [None]
f = BF.BatchForward.__call__
def g(*a, **k):
    t0 = pc(); r = f(*a, **k); bf_t[cur[0]] += pc() - t0; return r
BF.BatchForward.__call__ = g
stores = {}
caps = {}
def configure(v):
    model.__dict__["_selfspec_planners"] = stores.setdefault(v, {})
    stub = "stub" in v
    P.Planner.plan = bare_plan if stub else real_plan
    P.Planner.observe = (lambda self, rnd: None) if stub else real_obs
    extra = 0
    for part in v.split("-"):
        if part.startswith("cap"):
            extra = int(part[3:]) * (1 if v.startswith("ar") else -1)
    decoder_mod.row_capacity = lambda *a, **k: real_cap(*a, **k) + extra
    kw = dict(lookup=False, rho="none", draft_lora=False) if "off" in v else {}
    kw.update(lookup=False) if "nolk" in v else None
    kw.update(rho="none") if "norho" in v else None
    kw.update(draft_lora=False) if "nolora" in v else None
    return DecodeConfig(mode=v.split("-")[0].rstrip("2"), max_new_tokens=64, temperature=T, **kw)
for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)): pass
random.seed(2)
wall = collections.defaultdict(list)
for _ in range(reps):
    order = variants[:]; random.shuffle(order)
    for v in order:
        cfg = configure(v); cur[0] = v
        d = Decoder(model, enc, cfg, batch_size=B, seeds=list(range(len(enc))))
        t0 = pc()
        for _ in d: pass
        wall[v].append(pc() - t0)
        caps[v] = d._capacity
ref = wall[variants[0]]
print(f"# B = {B}, T = {T}, {reps} repeats in random order (tune prompts)")
for v in variants:
    ratios = [a / b for a, b in zip(ref, wall[v])]
    print(f"{v:18s} wall {sum(wall[v]) / reps * 1e3:7.1f} ms/pass  bf {bf_t[v] / reps * 1e3:7.1f} ms/pass  "
          f"{variants[0]}/this {sum(ref) / sum(wall[v]):.3f}  median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f}-{max(ratios):.3f})  cap {caps[v]}")
