"""When a kernel's small steps share out over the threads: whole forwards at each `PAR_MIN`.

The default model (w4a8, its compact cache), `--rows` rows of `--cached` tokens each, a causal
round of `--width` tokens a row plus the output head, through the runtime's `BatchForward`; the
threshold of `--kernel` (attn16: the exact attention's multiply-adds, `attn16_set_par_min`; layer:
the norms', RoPE's and the MLP gate's elements, `layer_set_par_min`), below which a step runs on
one thread, alternates between `--values` in one process (mirrored order each repeat), five calls
each time; the median per value, its ratio to the first value's, and whether every value gave the
same logits.

    python benchmarks/par_min.py --kernel attn16 --rows 4 --cached 80 --width 1 --values 262144 131072
    python benchmarks/par_min.py --kernel layer --rows 1 --width 8 --values 16384 2048
"""

import argparse
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernel", choices=["attn16", "layer"], default="attn16")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--cached", type=int, default=80)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--values", nargs="+", type=int, default=None,
                    help="thresholds to alternate (default: the old and the new one of --kernel)")
    ap.add_argument("--repeats", type=int, default=40)
    a = ap.parse_args()
    a.values = a.values or ([262144, 131072] if a.kernel == "attn16" else [16384, 2048])
    import torch

    import selfspec
    from selfspec.engine.batch_forward import BatchForward
    from selfspec.kernels import attn16, layer

    torch.set_num_threads(2)
    bf = BatchForward.of(selfspec.load(progress=False)[0])
    setp = attn16._fn("attn16_set_par_min") if a.kernel == "attn16" else layer._fn("layer_set_par_min")
    if setp is None:
        raise SystemExit(f"the {a.kernel} kernel is not built on this machine")
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
        print(f"rows {B}, {L} cached, width {w}: {a.kernel} PAR_MIN {v}: median {m * 1e3:.3f} ms, {m / base:.3f}x; "
              f"same logits {torch.equal(logits[v], logits[a.values[0]])}")


if __name__ == "__main__":
    main()
