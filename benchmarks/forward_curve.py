"""The cost of one forward by round width: what the planner reads, measured per weight format.

    python benchmarks/forward_curve.py                              # w4a8 and int4, 128 cached tokens
    python benchmarks/forward_curve.py --weights w4a8 --cached 128 1000 --widths 1 2 4 8 16

The default model, one row: a width-w forward (a causal block of w new tokens, as a verification
round) over `--cached` tokens plus the output head on its w rows, through the runtime's
`BatchForward`. Formats and cache lengths are interleaved in one process (each repeat visits them
all, in alternating order) and the fastest of `--repeats` x 3 calls is kept, so a burst of other
load on the machine does not land on one configuration. Prints one line per configuration and a
JSON record with the command: f(1) in ms and f(w) / f(1).
"""

import argparse
import json
import sys
import time


def cached_row(model, context, room: int):
    """(BatchForward, cache) of the model with one row holding `context` (token ids), `room` slots to spare."""
    import torch

    from selfspec.engine.batch_forward import BatchForward

    bf = BatchForward.of(model)
    cache = bf.new_cache(1, len(context) + room)
    bf(torch.as_tensor(context)[None], torch.arange(len(context))[None], cache, slice(0, 1), causal=True)
    cache.set_length(0, len(context))
    return bf, cache


def time_forward(bf, cache, tokens, positions) -> float:
    """Seconds of one forward + output head of the row's new tokens (a causal block: a chain's verification)."""
    import torch

    w = len(tokens)
    block = torch.full((w, w), float("-inf")).triu(1)[None]
    t0 = time.perf_counter()
    bf.logits(bf(torch.as_tensor(tokens)[None], torch.as_tensor(positions)[None], cache, slice(0, 1), block=block)[0])
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--weights", nargs="+", default=["w4a8", "int4"])
    ap.add_argument("--cached", nargs="+", type=int, default=[128])
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8, 12, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    import torch

    import selfspec

    torch.set_num_threads(a.threads)
    runs = {}
    for fmt in a.weights:
        model = selfspec.load(weights=fmt, progress=False)[0]
        for c in a.cached:
            runs[fmt, c] = cached_row(model, torch.arange(c) % 100 + 5, max(a.widths) + 8)
    best = {}
    keys = list(runs)
    for rep in range(a.repeats):
        for fmt, c in keys if rep % 2 == 0 else keys[::-1]:
            bf, cache = runs[fmt, c]
            for w in a.widths:
                for _ in range(3):
                    dt = time_forward(bf, cache, torch.arange(w) + 7, torch.arange(w))
                    best[fmt, c, w] = min(best.get((fmt, c, w), float("inf")), dt)
    out = {"command": "python benchmarks/forward_curve.py " + " ".join(sys.argv[1:]), "threads": a.threads,
           "curves": []}
    for fmt, c in keys:
        f1 = best[fmt, c, a.widths[0]]
        ratios = {w: round(best[fmt, c, w] / f1, 2) for w in a.widths}
        print(f"{fmt} cached {c}: f({a.widths[0]}) {f1 * 1e3:.2f} ms  " +
              "  ".join(f"f({w})/f({a.widths[0]}) {r:.2f}" for w, r in ratios.items() if w != a.widths[0]))
        out["curves"].append({"weights": fmt, "cached": c, "f1_ms": round(f1 * 1e3, 2), "ratio": ratios})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
