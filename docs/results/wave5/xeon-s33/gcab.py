# Session 33: ar / auto (and -nogc: the cyclic GC off during the decode) at B rows on a prompt file, pairs in a
# random order.   python gcab.py B REPEATS T PROMPTS VARIANTS
import collections, gc, random, statistics, sys, time
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
B, reps, T, path = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
variants = sys.argv[5].split(",")
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p["prompt"]) for p in read_prompts(path)][:16]
for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)): pass
random.seed(1)
wall = collections.defaultdict(list)
for _ in range(reps):
    order = variants[:]; random.shuffle(order)
    for v in order:
        mode = v.split("-")[0].rstrip("2")
        d = Decoder(model, enc, DecodeConfig(mode=mode, max_new_tokens=64, temperature=T), batch_size=B, seeds=list(range(16)))
        nogc = "nogc" in v
        if nogc: gc.disable()
        t0 = time.perf_counter()
        for _ in d: pass
        wall[v].append(time.perf_counter() - t0)
        if nogc: gc.enable()
ref = wall[variants[0]]
for v in variants:
    ratios = [a / b for a, b in zip(ref, wall[v])]
    print(f"{v:12s} {sum(wall[v]):7.3f} s  ref/this {sum(ref) / sum(wall[v]):.3f}  median {statistics.median(ratios):.3f}")
