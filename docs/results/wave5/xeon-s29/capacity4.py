"""One-token forwards of 4 rows (100-160 cached tokens each, the same K/V bits copied) in KV caches of different
capacities, rotated in one process, the fastest of 6 x 8 calls each. python capacity4.py CAP..."""
import time, torch, sys
from selfspec.loading import load
from selfspec.engine.batch_forward import BatchForward
model, tok = load(progress=False)
bf = BatchForward.of(model)
ids = tok.encode(open("/usr/lib/python3.11/argparse.py").read())
lens = [100, 120, 140, 160]
R = 4
src = bf.new_cache(R, 400)
with torch.inference_mode():
    for r, L in enumerate(lens):
        bf(torch.tensor([ids[r * 200: r * 200 + L]]), torch.arange(L)[None], src, slice(r, r + 1), causal=True)
        src.set_length(r, L)
caps = [int(c) for c in sys.argv[1:]]
def make(cap):
    c = bf.new_cache(R, cap)
    for i in range(len(src.k)):
        c.k[i][:, :, :161] = src.k[i][:, :, :161]; c.v[i][:, :, :161] = src.v[i][:, :, :161]
    for i in range(len(src.shifts)):
        c.shifts[i][:, :, :161] = src.shifts[i][:, :, :161]
    for r, L in enumerate(lens):
        c.set_length(r, L)
    return c
with torch.inference_mode():
    caches = {cap: make(cap) for cap in caps}
tokn = torch.tensor([[ids[-1]]] * R); pos = torch.tensor([[L] for L in lens])
res = {c: [] for c in caps}
with torch.inference_mode():
    for rep in range(6):
        for cap in (caps if rep % 2 == 0 else caps[::-1]):
            c = caches[cap]
            for _ in range(3): bf(tokn, pos, c, slice(0, R))
            ts = []
            for _ in range(8):
                t0 = time.perf_counter(); bf(tokn, pos, c, slice(0, R)); ts.append(time.perf_counter() - t0)
            res[cap].append(min(ts))
for cap in caps:
    v = sorted(res[cap])
    print(cap, f"best {v[0]*1e3:.3f} ms median {v[len(v)//2]*1e3:.3f}", f"(head stride {cap*64} B, mod 4096 = {cap*64 % 4096})")
