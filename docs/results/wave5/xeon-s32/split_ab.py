"""Mode "ar" against mode "auto" with its planner stubbed out (a bare AR round every round, nothing
learnt), B rows at a time over the 16 tune prompts, 64 tokens, REPEATS pairs in random order: the
one-call block's C time apart from the rest of the wall (the head, sampling, Python).

    python docs/results/wave5/xeon-s32/split_ab.py B REPEATS"""
import sys, time, collections, random, statistics
import selfspec.engine.planner as P
from selfspec.engine.layouts import AR
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
import selfspec.kernels.block as kb, selfspec.kernels.w4a8 as w4
B, reps = int(sys.argv[1]), int(sys.argv[2])
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
def bare_plan(self, rnd):
    self.predicted = None; rnd.bare = True; return AR
P.Planner.plan = bare_plan; P.Planner.observe = lambda self, rnd: None
acc = collections.defaultdict(float)
real = kb._entry()
def blk(*a):
    t0 = time.perf_counter(); r = real(*a); acc["block"] += time.perf_counter() - t0; return r
kb._entry = lambda: blk
for k in list(w4._entry):
    f = w4._entry[k]
    if f:
        def g(*a, _f=f):
            t0 = time.perf_counter(); r = _f(*a); acc["w4a8/w8a8"] += time.perf_counter() - t0; return r
        w4._entry[k] = g
import selfspec.engine.step as S
res = collections.defaultdict(lambda: collections.defaultdict(list))
random.seed(2)
for rep in range(reps):
    order = ["ar", "auto"]; random.shuffle(order)
    for mode in order:
        acc.clear()
        d = Decoder(model, enc, DecodeConfig(mode=mode, max_new_tokens=64), batch_size=B, seeds=list(range(len(enc))))
        t0 = time.perf_counter()
        for _ in d: pass
        w = time.perf_counter() - t0
        res[mode]["wall"].append(w)
        for k, v in acc.items(): res[mode][k].append(v)
        res[mode]["other"].append(w - sum(acc.values()))
for k in res["ar"]:
    a, b = res["ar"][k], res["auto"][k]
    print(f"{k:12s} ar {sum(a)/reps*1e3:8.1f} ms  auto-stub {sum(b)/reps*1e3:8.1f} ms  ratio {sum(b)/sum(a):.3f}  paired median {statistics.median(y/x for x, y in zip(a, b)):.3f}")
