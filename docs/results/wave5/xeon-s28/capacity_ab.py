"""One-token forwards over the same 3,000 cached tokens (the first 3,000 tokens of Python's
argparse.py) in KV caches of different capacities (the K/V copied, so the bits are the same), the
capacities rotated in one process, the fastest of 6 x 8 calls each. Run from the checkout's root:

    python docs/results/wave5/xeon-s28/capacity_ab.py 3072 3073 3099 3100 3136 3137 3163 3164 3200 3201 3263 3264
"""
import time, torch, sys
from selfspec.loading import load
from selfspec.engine.batch_forward import BatchForward
model, tok = load(progress=False)
bf = BatchForward.of(model)
ids = tok.encode(open("/usr/lib/python3.11/argparse.py").read())[:3000]
L = len(ids)
src = bf.new_cache(1, L + 200)
with torch.inference_mode():
    for a in range(0, L, 128):
        bf(torch.tensor([ids[a:a+128]]), torch.arange(a, min(a+128, L))[None], src, slice(0, 1), causal=True)
        src.set_length(0, min(a + 128, L))
caps = [int(c) for c in sys.argv[1:]]
res = {c: [] for c in caps}
def make(cap):
    c = bf.new_cache(1, cap)
    for i in range(len(src.k)):
        c.k[i][:, :, :L] = src.k[i][:, :, :L]; c.v[i][:, :, :L] = src.v[i][:, :, :L]
    for i in range(len(src.shifts)):
        c.shifts[i][:, :, :L] = src.shifts[i][:, :, :L]
    c.set_length(0, L)
    return c
with torch.inference_mode():
    caches = {cap: make(cap) for cap in caps}
tokn = torch.tensor([[ids[-1]]]); pos = torch.tensor([[L]])
with torch.inference_mode():
    for rep in range(6):
        for cap in (caps if rep % 2 == 0 else caps[::-1]):
            c = caches[cap]
            for _ in range(3): bf(tokn, pos, c, slice(0, 1))
            ts = []
            for _ in range(8):
                t0 = time.perf_counter(); bf(tokn, pos, c, slice(0, 1)); ts.append(time.perf_counter() - t0)
            res[cap].append(min(ts))
for cap in caps:
    print(cap, f"{min(res[cap])*1e3:.3f} ms", f"(stride {cap*64} B, mod 4096 = {cap*64 % 4096})")
