"""A one-token forward's time after a gap of X us of Python (busy, touching nothing / touching M KiB)."""
import time, sys, torch
import selfspec
from selfspec.engine.batch_forward import BatchForward
torch.set_num_threads(2)
model = selfspec.load(progress=False)[0]
bf = BatchForward.of(model)
cache = bf.new_cache(1, 256)
ids = torch.arange(64) % 100 + 5
bf(ids[None], torch.arange(64)[None], cache, slice(0, 1), causal=True)
cache.set_length(0, 64)
tok, pos = torch.tensor([[7]]), torch.tensor([[0]])
junk = [list(range(1000)) for _ in range(64)]  # python objects to walk (~2.3 MB)
def fwd():
    t0 = time.perf_counter(); bf.logits(bf(tok, pos, cache, slice(0, 1))[0]); return time.perf_counter() - t0
def spin(n):
    x = 0
    for i in range(n):
        x += i
    return x
t0 = time.perf_counter(); spin(1000000); PER_US = 1000000 / ((time.perf_counter() - t0) * 1e6)
def gap(us, touch):
    spin(int(us * PER_US))
res = {}
for rep in range(4):
    for us in (0, 300, 1000, 3000):
        for touch in (0,):
            ts = []
            for _ in range(30):
                gap(us, touch); ts.append(fwd())
            ts.sort()
            res.setdefault((us, touch), []).append(ts[len(ts) // 2])
for k, v in sorted(res.items()):
    print(f"gap {k[0]:5d} us touch {k[1]:2d}: median forward {sorted(v)[len(v)//2]*1e3:.3f} ms (runs {' '.join(f'{x*1e3:.2f}' for x in v)})")
