"""What the draft LoRA adds to a forward: the median time of one forward of w query tokens over
100 cached tokens, with and without the LoRA on the mask rows (a probe is w = 5: the root and a
group of 4), head on the root only or on every row.

    python benchmarks/lora_cost.py [--widths 1 5 9 17] [--weights int4] [--repeats 15]
    python benchmarks/lora_cost.py --rev HEAD --widths 5 9 17   # a revision's layer.c against the working tree's

--rev: the LoRA kernel of that revision's `layer.c` and the working tree's take turns in the one-call
block (its `lora` pointer swapped) in one process, each the fastest of 5 forwards a turn, six turns
(A B, then B A: this machine's speed drifts), and the LoRA's rows compared bit for bit.

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
    ap.add_argument("--rev", default=None, help="A/B against this git revision's LoRA kernel (see above)")
    a = ap.parse_args(argv)
    if a.rev is not None:
        return rev_ab(a)

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


def rev_ab(a) -> int:
    import ctypes
    import os
    import tempfile

    import torch

    import selfspec
    from selfspec.engine.batch_forward import BatchForward
    from selfspec.kernels import block
    from selfspec.kernels import build as kb

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attn_model_ab import kernel_files

    model, _ = selfspec.load(weights=a.weights, progress=False)
    lora = getattr(model, "draft_lora", None)
    if lora is None or block._entry() is None:
        raise SystemExit("error: needs the draft LoRA and the one-call block (a C compiler)")
    with tempfile.TemporaryDirectory() as tmp:
        kernel_files(a.rev, ("layer", "bf16"), tmp)  # layer.c with its own revision's headers
        err = kb.compile_c(kb.compiler(), os.path.join(tmp, "layer.c"), os.path.join(tmp, "rev.so"), kb.FLAGS)
        if err:
            raise SystemExit(f"lora_cost: {a.rev}: {err}")
        lib = ctypes.CDLL(os.path.join(tmp, "rev.so"))
    bf = BatchForward.of(model)
    cache = bf.new_cache(1, 100 + max(a.widths) + 1)
    ids = torch.arange(100) % 1000 + 5
    bf(ids[None], torch.arange(100)[None], cache, slice(0, 1), causal=True)
    cache.set_length(0, 100)
    ours = block._state["kn"]
    theirs = block._Kernels.from_buffer_copy(ours)
    theirs.lora = ctypes.cast(lib.layer_lora, ctypes.c_void_p).value
    kernels = {a.rev: theirs, "working tree": ours}
    report = {"command": "python benchmarks/lora_cost.py " + " ".join(sys.argv[1:]), "ms": {}}
    try:
        for w in [w for w in a.widths if w > 1]:
            mask = torch.zeros(1, w, w)
            mask[0, 0, 1:] = float("-inf")
            best, outs = {}, {}
            for turn in range(6):
                for name in list(kernels) if turn % 2 == 0 else list(kernels)[::-1]:
                    block._state["kn"] = kernels[name]
                    for with_lora in (False, True):
                        kw = dict(lora=lora, lora_rows=slice(1, None)) if with_lora else {}
                        for _ in range(5):
                            t0 = time.perf_counter()
                            h = bf(torch.arange(w)[None] + 7, torch.arange(w)[None], cache, slice(0, 1), block=mask,
                                   **kw)
                            best[name, with_lora] = min(best.get((name, with_lora), 1e9), time.perf_counter() - t0)
                        outs[name, with_lora] = h
            added = {name: 1000 * (best[name, True] - best[name, False]) for name in kernels}
            same = torch.equal(outs[a.rev, True], outs["working tree", True])
            print(f"width {w}: the LoRA adds {added[a.rev]:.2f} ms with {a.rev}'s kernel, {added['working tree']:.2f} "
                  f"ms with the working tree's (the forward without it: {1000 * best['working tree', False]:.2f} ms); "
                  f"same bits: {same}", flush=True)
            report["ms"][f"w={w}"] = {k: round(v, 3) for k, v in added.items()} | {"same": same}
    finally:
        block._state["kn"] = ours
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
