"""Python outside the C block and head calls per forward + logits (one row, width 1, CACHED tokens, default 64).
    python docs/results/wave5/xeon-s30/pyshare.py [CACHED]"""
import sys, time, torch, selfspec
import selfspec.kernels.block as kb, selfspec.kernels.w4a8 as w4
from selfspec.engine.batch_forward import BatchForward
model, tok = selfspec.load(progress=False)
bf = BatchForward.of(model)
c = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ids = torch.arange(c) % 100 + 5
cache = bf.new_cache(1, c + 4000)
bf(ids[None], torch.arange(c)[None], cache, slice(0, 1), causal=True)
cache.set_length(0, c)
toks, pos = torch.tensor([[7]]), torch.tensor([[0]])
for i in range(50): bf.logits(bf(toks, pos, cache, slice(0, 1))[0])
inC = [0.0]
def wrapc(fn):
    def f(*a):
        t0 = time.perf_counter(); r = fn(*a); inC[0] += time.perf_counter() - t0; return r
    return f
real_entry = kb._entry
blockfn = wrapc(real_entry())
kb._entry = lambda: blockfn
for k in list(w4._entry):
    if w4._entry[k]: w4._entry[k] = wrapc(w4._entry[k])
for rep in range(3):
    inC[0] = 0.0; n = 1000
    t0 = time.perf_counter()
    for i in range(n): bf.logits(bf(toks, pos, cache, slice(0, 1))[0])
    tot = time.perf_counter() - t0
    print(f"forward+logits {tot/n*1e6:.0f} us, in C {inC[0]/n*1e6:.0f} us, outside {(tot-inC[0])/n*1e6:.0f} us")
