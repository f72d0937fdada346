"""What the draft LoRA adds to a forward: the median time of one forward of w query tokens over
100 cached tokens, with and without the LoRA on the mask rows (a probe is w = 5: the root and a
group of 4), head on the root only or on every row.

    python benchmarks/lora_cost.py [--widths 1 5 9 17] [--weights int4] [--repeats 15]

Run it alone: timings move with anything else on the machine. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 5, 9, 17])
    ap.add_argument("--weights", default=None)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args(argv)

    import torch

    import selfspec
    from selfspec.engine.batch_forward import BatchForward

    model, _ = selfspec.load(weights=a.weights, progress=False)
    lora = getattr(model, "draft_lora", None)
    if lora is None:
        raise SystemExit("error: this model has no draft LoRA (linear_spec_lora/)")
    bf = BatchForward.of(model)
    cache = bf.new_cache(1, 100 + max(a.widths) + 1)
    ids = torch.arange(100) % 1000 + 5
    bf(ids[None], torch.arange(100)[None], cache, slice(0, 1), causal=True)
    cache.set_length(0, 100)

    def forward(w: int, with_lora: bool) -> float:
        block = torch.zeros(1, w, w)
        block[0, 0, 1:] = float("-inf")  # the root sees itself; the mask group sees the root and itself
        kw = dict(lora=lora, lora_rows=slice(1, None)) if with_lora and w > 1 else {}
        t0 = time.perf_counter()
        h = bf(torch.arange(w)[None] + 7, torch.arange(w)[None], cache, slice(0, 1), block=block if w > 1 else None,
               **kw)
        bf.logits(h[0])
        return time.perf_counter() - t0

    report = {"command": " ".join(["python benchmarks/lora_cost.py", *(sys.argv[1:] if argv is None else argv)]),
              "ms": {}}
    for w in a.widths:
        for with_lora in (False, True):
            for _ in range(3):
                forward(w, with_lora)
            ts = sorted(forward(w, with_lora) for _ in range(a.repeats))
            report["ms"][f"w={w}{' lora' if with_lora else ''}"] = round(1000 * ts[len(ts) // 2], 2)
    print("| width | no LoRA ms | LoRA on the mask rows ms |\n|---|---|---|")
    for w in a.widths:
        print(f"| {w} | {report['ms'][f'w={w}']} | {report['ms'][f'w={w} lora']} |")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
