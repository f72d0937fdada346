"""One layer's exact attention (`attn16_direct`: store, scores, weights, weighted sums) of two builds
of attn16.c side by side: the committed one (git show REV:selfspec/kernels/attn16.c) and the
working tree's, interleaved in one process, the same inputs, outputs checked equal.

    git show HEAD~1:selfspec/kernels/attn16.c > /tmp/attn16_old.c && python benchmarks/attn_ab.py

Prints per cache length S and round width w the fastest of 7 x 20 calls of each build.
"""
import ctypes, os, sys, time, torch
from selfspec.kernels import build, attn16
from selfspec.engine.cache import BatchKVCache
from selfspec.engine.attention import grid_for
torch.set_num_threads(2)
libs = {}
for name, src in (("old", "/tmp/attn16_old.c"), ("new", os.path.join(build.HERE, "attn16.c"))):
    out = f"/tmp/ab_{name}.so"
    assert build.compile_c(build.compiler(), src, out, build.FLAGS) is None
    lib = ctypes.CDLL(out); fn = lib.attn16_direct; fn.argtypes = attn16._DIRECT; fn.restype = ctypes.c_int
    libs[name] = fn
for S in (128, 1000, 3000):
    for w in (1, 4):
        R = 1
        g = torch.Generator().manual_seed(0)
        cache = BatchKVCache([torch.device("cpu")], 3, 64, R, S + 16, torch.int16)
        # keys like a real model's: a few dominant, most far below (sparse softmax weights)
        old = torch.round(torch.randn(R, 3, S - 1, 64, generator=g, dtype=torch.float64) * 2.0 ** 12)
        cache.write(0, slice(0, R), [0] * R, old, old * 0.5)
        x = torch.round(torch.randn(R, w, 15, 64, generator=g, dtype=torch.float64) * 2.0 ** 12)
        grid = grid_for(64, 2.0 ** 4, 2.0 ** 4, 2.0 ** 3, 4096)
        k, ks, v, vs = cache.k[0], cache.shifts[0], cache.v[0], cache.shifts[1]
        o = torch.empty(R, w, 9 * 64, dtype=torch.bfloat16)
        st = (ctypes.c_int64 * R)(S - 1)
        args = lambda: (x.data_ptr(), R, w, 9, 3, 64, ctypes.addressof(st), S - 1 + w, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), ks.data_ptr(), vs.data_ptr(), ks.stride(0), ks.stride(1), None, 0, 0, grid.scale, grid.shift, 2.0 ** grid.v, o.data_ptr(), 2)
        best = {}
        outs = {}
        for rep in range(7):
            for name in (("old", "new") if rep % 2 == 0 else ("new", "old")):
                fn = libs[name]; a = args()
                t0 = time.perf_counter()
                for _ in range(20): fn(*a)
                dt = (time.perf_counter() - t0) / 20
                best[name] = min(best.get(name, 1e9), dt)
                outs[name] = o.clone()
        assert torch.equal(outs["old"], outs["new"])
        print(f"S={S} w={w}: old {best['old']*1e6:.0f} us, new {best['new']*1e6:.0f} us ({best['old']/best['new']:.2f}x)")
