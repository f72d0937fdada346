# Session 33: one width-1 forward of 8 rows over 60 cached tokens, repeated, per KV-cache capacity (slots a row).
import time, torch, statistics
from selfspec.loading import load
from selfspec.engine.batch_forward import BatchForward
model, tok = load(None, progress=False)
bf = BatchForward.of(model)
R = 8
caches = {}
CAPS = (112, 175, 128, 192, 113)
for cap in CAPS:
    c = bf.new_cache(R, cap)
    toks = torch.randint(0, 1000, (R, 60))
    with torch.inference_mode():
        bf(toks, torch.arange(60).expand(R, 60), c, slice(0, R), causal=True)
    for r in range(R):
        c.set_length(r, 60)
    caches[cap] = c
tok1 = torch.randint(0, 1000, (R, 1)); off = torch.zeros(R, 1, dtype=torch.long)
t = {c: [] for c in CAPS}
import random
with torch.inference_mode():
    for i in range(400):
        order = list(CAPS); random.shuffle(order)
        for cap in order:
            t0 = time.perf_counter(); bf(tok1, off, caches[cap], slice(0, R)); t[cap].append(time.perf_counter() - t0)
for cap in t:
    print(cap, f"mean {statistics.mean(t[cap])*1e3:.3f} ms median {statistics.median(t[cap])*1e3:.3f} ms")
