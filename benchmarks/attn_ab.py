"""One layer's exact attention (`attn16_direct`: store, scores, weights, weighted sums) of two builds
of attn16.c side by side: the one at a git revision (with that revision's headers) and the working
tree's, interleaved in one process on the same inputs, outputs compared.

    python benchmarks/attn_ab.py --rev HEAD~1
    python benchmarks/attn_ab.py --rev ceeada7 --keys 80 200 --widths 1 2 4 8 16

Random grid integers, scores spread over a few units (weights of every size). Prints per cache
length S and round width w the fastest of 8 x 20 calls of each build. For the real model's
attention on real text use `attn_model_ab.py`.
"""
import argparse
import ctypes
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_model_ab import old_direct  # noqa: E402

from selfspec.engine.cache import BatchKVCache  # noqa: E402
from selfspec.kernels import attn16, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--keys", type=int, nargs="+", default=[128, 1000, 3000])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-dtype", default="int16", choices=["int16", "int8"],
                    help="the cache both builds read (int8: builds from 8861d85 on)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    fns = {}
    for name, lib in (("old", old_direct(a.rev)), ("new", build.load("attn16"))):
        fn = lib.attn16_direct
        fn.argtypes, fn.restype = attn16._DIRECT, ctypes.c_int
        fns[name] = fn
    for S in a.keys:
        for w in a.widths:
            g = torch.Generator().manual_seed(0)
            cache = BatchKVCache([torch.device("cpu")], 3, 64, 1, S + 32, getattr(torch, a.kv_cache_dtype))
            old = torch.round(torch.randn(1, 3, S - w, 64, generator=g, dtype=torch.float64) * 2.0 ** 12)
            cache.write(0, slice(0, 1), [0], old, old * 0.5)
            x = torch.round(torch.randn(1, w, 15, 64, generator=g, dtype=torch.float64) * 2.0 ** 12)
            k, ks, v, vs = cache.k[0], cache.shifts[0], cache.v[0], cache.shifts[1]
            mask = torch.zeros(w, S, dtype=torch.float64)
            for t in range(w):
                mask[t, S - w + t + 1:] = float("-inf")
            o = torch.empty(1, w, 9 * 64, dtype=torch.bfloat16)
            st = (ctypes.c_int64 * 1)(S - w)
            args = (x.data_ptr(), 1, w, 9, 3, 64, ctypes.addressof(st), S, k.data_ptr(), v.data_ptr(), k.stride(0),
                    k.stride(1), ks.data_ptr(), vs.data_ptr(), ks.stride(0), ks.stride(1), mask.data_ptr(), 0,
                    mask.stride(0), 2.0 ** -26, 20 * math.log(2.0), 2.0 ** 10, o.data_ptr(), a.threads,
                    k.element_size())  # a build before the one-byte cache takes no such argument: ignored
            best, outs = {}, {}
            for rep in range(8):
                for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fns[name](*args)
                    best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / 20)
                    outs[name] = o.clone()
            print(f"S={S} w={w}: old {best['old'] * 1e6:.0f} us, new {best['new'] * 1e6:.0f} us "
                  f"({best['old'] / best['new']:.2f}x), same output: {torch.equal(outs['old'], outs['new'])}", flush=True)


if __name__ == "__main__":
    main()
