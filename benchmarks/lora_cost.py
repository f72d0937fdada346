"""What the draft LoRA adds to a forward: the median time of one forward of w query tokens over
100 cached tokens, with and without the LoRA on the mask rows (a probe is w = 5: the root and a
group of 4), head on the root only or on every row.

    python benchmarks/lora_cost.py [--widths 1 5 9 17] [--weights int4] [--repeats 15]
    python benchmarks/lora_cost.py --rev HEAD --widths 5 9 17   # a revision's layer.c against the working tree's

--rev: that revision's one-call block (its block.c, layer.c, w4a8.c and attn16.c built with their
own headers, and its LoRA tables: fp32 before the int8 tables, int8 since) and the working tree's
take turns in one process, each the fastest of 5 forwards a turn, six turns (A B, then B A: this
machine's speed drifts); the outputs with the LoRA compared bit for bit (the same only where both
revisions' LoRA numerics are).

Run it alone: timings move with anything else on the machine. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from selfspec.checkpoint.lora import draft_rows


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


def rev_tables(lora, n_layers: int, int8: bool):
    """A draft LoRA's pointer tables in a one-call block's layout: int8 (`w4a8.pack_lora`, 4 a
    module: the working tree's) or fp32 A^T / scale B^T (2 a module: before the int8 tables)."""
    import ctypes

    import torch

    from selfspec.checkpoint.lora import GROUPS
    from selfspec.kernels import block, w4a8

    mods = [lora.ab.get(n, [None] * n_layers)[i] for i in range(n_layers) for g in GROUPS for n in g]
    if int8:
        return block.lora_of([None if ab is None else w4a8.pack_lora(ab[0].float(), ab[1].float() * lora.scale)
                              for ab in mods])
    keep = [None if ab is None else (ab[0].float().T.contiguous(), (ab[1].float() * lora.scale).T.contiguous())
            for ab in mods]
    ptrs = [p for ab in keep for p in ([0, 0] if ab is None else [ab[0].data_ptr(), ab[1].data_ptr()])]
    ranks = [0 if ab is None else ab[0].shape[1] for ab in keep]
    return ((ctypes.c_void_p * len(ptrs))(*ptrs), (ctypes.c_int64 * len(ranks))(*ranks), keep)


def rev_block(rev: str, tmp: str):
    """(block_layers, its kernels' struct, whether its LoRA takes int8 tables) of git revision
    `rev`: its block.c, layer.c, w4a8.c and attn16.c with their own headers, built in `tmp`."""
    import ctypes
    import os

    from selfspec.kernels import block
    from selfspec.kernels import build as kb

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from attn_model_ab import kernel_files

    kernel_files(rev, ("block", "layer", "bf16", "w4a8", "w8a8", "lora8", "attn16"), tmp)
    libs = {}
    for name in ("block", "layer", "w4a8", "attn16"):
        err = kb.compile_c(kb.compiler(), os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so"), kb.FLAGS)
        if err:
            raise SystemExit(f"lora_cost: {rev}: {name}.c: {err}")
        libs[name] = ctypes.CDLL(os.path.join(tmp, f"{name}.so"))
    with open(os.path.join(tmp, "block.c")) as f:
        int8 = "linear_lora_t" in f.read()
    ptr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    bl, ll, wl, al = libs["block"], libs["layer"], libs["w4a8"], libs["attn16"]
    common = [al.attn16_direct, ll.layer_rms, ll.layer_add_rms, ll.layer_rope, ll.layer_silu_mul]
    if int8:
        fields = ("direct", "rms", "add_rms", "rope", "silu_mul", "linear")
        fns = common + [wl.w4a8_linear_lora]
    else:
        fields = ("linear", "direct", "rms", "add_rms", "rope", "silu_mul", "lora")
        fns = [wl.w4a8_linear] + common + [ll.layer_lora]
    Kernels = type("Kernels", (ctypes.Structure,), {"_fields_": [(n, ctypes.c_void_p) for n in fields]})
    fn = bl.block_layers
    fn.argtypes, fn.restype = block._ARGS, ctypes.c_int
    return fn, Kernels(*map(ptr, fns)), int8, libs


def rev_ab(a) -> int:
    import tempfile

    import torch

    import selfspec
    from selfspec.engine.batch_forward import BatchForward
    from selfspec.kernels import block

    model, _ = selfspec.load(weights=a.weights, progress=False)
    lora = getattr(model, "draft_lora", None)
    if lora is None or block._entry() is None:
        raise SystemExit("error: needs the draft LoRA and the one-call block (a C compiler)")
    bf = BatchForward.of(model)
    cache = bf.new_cache(1, 100 + max(a.widths) + 1)
    ids = torch.arange(100) % 1000 + 5
    bf(ids[None], torch.arange(100)[None], cache, slice(0, 1), causal=True)
    cache.set_length(0, 100)
    n_layers = len(model.encoder.layers)
    ours = (block._state["fn"], block._state["kn"], True)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = rev_block(a.rev, tmp)
        sides = {a.rev: (*theirs[:3], rev_tables(lora, n_layers, theirs[2])),
                 "working tree": (*ours, rev_tables(lora, n_layers, True))}
        report = {"command": "python benchmarks/lora_cost.py " + " ".join(sys.argv[1:]), "ms": {}}
        real_args = type(lora).block_args
        try:
            for w in [w for w in a.widths if w > 1]:
                mask = torch.zeros(1, w, w)
                mask[0, 0, 1:] = float("-inf")
                best, outs = {}, {}
                for turn in range(6):
                    for name in list(sides) if turn % 2 == 0 else list(sides)[::-1]:
                        fn, kn, _, tables = sides[name]
                        block._state["fn"], block._state["kn"] = fn, kn
                        type(lora).block_args = lambda self, L, R, q, cols, t=tables: (t, draft_rows(R, q, cols))
                        for with_lora in (False, True):
                            kw = dict(lora=lora, lora_rows=slice(1, None)) if with_lora else {}
                            for _ in range(5):
                                t0 = time.perf_counter()
                                h = bf(torch.arange(w)[None] + 7, torch.arange(w)[None], cache, slice(0, 1),
                                       block=mask, **kw)
                                best[name, with_lora] = min(best.get((name, with_lora), 1e9), time.perf_counter() - t0)
                            outs[name, with_lora] = h
                added = {name: 1000 * (best[name, True] - best[name, False]) for name in sides}
                same = torch.equal(outs[a.rev, True], outs["working tree", True])
                top1 = [bf.logits(outs[k, True][0, 1:]).argmax(-1) for k in sides]  # the draft rows' tokens
                agree = float((top1[0] == top1[1]).float().mean())
                print(f"width {w}: the LoRA adds {added[a.rev]:.2f} ms with {a.rev}'s block, "
                      f"{added['working tree']:.2f} ms with the working tree's (the forward without it: "
                      f"{1000 * best['working tree', False]:.2f} ms / {1000 * best[a.rev, False]:.2f}); "
                      f"same bits with the LoRA: {same}; the drafts' top-1 agree on {agree:.0%} of "
                      f"{w - 1} rows", flush=True)
                report["ms"][f"w={w}"] = {k: round(v, 3) for k, v in added.items()} | {"same": same, "top1": agree} | {
                    f"base {k}": round(1000 * best[k, False], 3) for k in sides}
        finally:
            block._state["fn"], block._state["kn"] = ours[:2]
            type(lora).block_args = real_args
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
