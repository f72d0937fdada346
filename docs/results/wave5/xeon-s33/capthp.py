# Session 33: capbench.py with the cache tensors also copied into buffers advised for transparent huge pages (MADV_HUGEPAGE).
import mmap, random, statistics, time, torch
from selfspec.loading import load
from selfspec.engine.batch_forward import BatchForward
model, tok = load(None, progress=False)
bf = BatchForward.of(model)
R = 8
KEEP = []
def huge_copy(t):
    n = t.numel() * t.element_size()
    size = ((n + (1 << 21) - 1) >> 21) << 21
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    KEEP.append(m)
    b = torch.frombuffer(m, dtype=torch.uint8)[:n].view(t.dtype).view(t.shape)
    b.copy_(t)
    return b
caches = {}
for name, cap, thp in (("112", 112, False), ("175", 175, False), ("112thp", 112, True), ("175thp", 175, True)):
    c = bf.new_cache(R, cap)
    if thp:
        c.k = [huge_copy(t) for t in c.k]; c.v = [huge_copy(t) for t in c.v]; c.shifts = [huge_copy(t) for t in c.shifts]
    toks = torch.randint(0, 1000, (R, 60))
    with torch.inference_mode():
        bf(toks, torch.arange(60).expand(R, 60), c, slice(0, R), causal=True)
    for r in range(R):
        c.set_length(r, 60)
    caches[name] = c
print("AnonHugePages", [l for l in open("/proc/meminfo") if "AnonHuge" in l])
tok1 = torch.randint(0, 1000, (R, 1)); off = torch.zeros(R, 1, dtype=torch.long)
t = {n: [] for n in caches}
with torch.inference_mode():
    for i in range(400):
        order = list(caches); random.shuffle(order)
        for n in order:
            t0 = time.perf_counter(); bf(tok1, off, caches[n], slice(0, R)); t[n].append(time.perf_counter() - t0)
for n in t:
    print(n, f"mean {statistics.mean(t[n])*1e3:.3f} ms median {statistics.median(t[n])*1e3:.3f} ms")
