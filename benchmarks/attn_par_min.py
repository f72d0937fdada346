"""When the exact attention's steps share out over the threads: whole forwards at each `PAR_MIN`.

The default model (w4a8, its compact cache), `--rows` rows of `--cached` tokens each, a causal
round of `--width` tokens a row plus the output head, through the runtime's `BatchForward`; the
attention's threshold (`attn16_set_par_min`: multiply-adds below which a step runs on one thread)
alternates between `--values` in one process (mirrored order each repeat), five calls each time;
the median per value, its ratio to the first value's, and whether every value gave the same logits.

    python benchmarks/attn_par_min.py --rows 4 --cached 80 --width 1 --values 262144 131072
    python benchmarks/attn_par_min.py --rows 1 --cached 80 --width 16 --repeats 60
"""

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--cached", type=int, default=80)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--values", nargs="+", type=int, default=[262144, 131072])
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args()
    import torch

    import selfspec
    from selfspec.engine.batch_forward import BatchForward
    from selfspec.kernels import attn16

    torch.set_num_threads(2)
    bf = BatchForward.of(selfspec.load(progress=False)[0])
    setp = attn16._fn("attn16_set_par_min")
    if setp is None:
        raise SystemExit("the attn16 kernel is not built on this machine")
    B, L, w = a.rows, a.cached, a.width
    cache = bf.new_cache(B, L + w + 64)
    for r in range(B):
        ids = (torch.arange(L) * (r + 3)) % 500 + 5
        bf(ids[None], torch.arange(L)[None], cache, slice(r, r + 1), causal=True)
        cache.set_length(r, L)
    toks, offs = (torch.arange(B * w) + 7).view(B, w), torch.arange(w).expand(B, w)
    block = torch.full((w, w), float("-inf")).triu(1).expand(B, w, w)
    times, logits = {v: [] for v in a.values}, {}
    old = setp(a.values[0])
    try:
        for rep in range(a.repeats):
            for v in a.values if rep % 2 == 0 else a.values[::-1]:
                setp(v)
                for _ in range(5):
                    t0 = time.perf_counter()
                    logits[v] = bf.logits(bf(toks, offs, cache, slice(0, B), block=block))
                    times[v].append(time.perf_counter() - t0)
    finally:
        setp(old)
    base = statistics.median(times[a.values[0]])
    for v in a.values:
        m = statistics.median(times[v])
        print(f"rows {B}, {L} cached, width {w}: PAR_MIN {v}: median {m * 1e3:.3f} ms, {m / base:.3f}x; "
              f"same logits {torch.equal(logits[v], logits[a.values[0]])}")


if __name__ == "__main__":
    main()
