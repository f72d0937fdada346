"""Two builds of the w4a8 kernel against each other in one process: a git revision's `w4a8.c`
and the working tree's, on the default model's matmul shapes, by number of rows.

    python benchmarks/w4a8_ab.py                     # HEAD against the working tree, 1..64 rows
    python benchmarks/w4a8_ab.py --rev 2a4807c --rows 1 4 8 16 --repeats 9
    python benchmarks/w4a8_ab.py --model --rows 1 2 4 8 16 --repeats 10   # the default model's whole forward

The machine's speed drifts (up to 1.5x within minutes on the 2-core AVX2 machine), so the two
builds alternate inside every repeat (A B, then B A) and the fastest repeat of each is kept. Per
row count: one decoder layer's seven matmuls (q, k, v, o, gate, up, down; random weights, the
default model's shapes) and the w8a8 output head (49,152 x 576), both builds checked to give the
same bits. Prints one line per row count and a JSON record with the command.

--model: instead, the default model's forward of a causal block of that many tokens after 64
cached (its layers in the one-call block, `kernels.block`, whose matmul pointer is swapped between
the builds; the output head is the working tree's in both), the fastest of repeats x 5 forwards of
each build, logits compared (`attn_model_ab.widths`). The weights then stream from memory as in
decoding, which one layer's shapes alone do not show.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # [N, K]
HEAD = (49152, 576)


def build(rev: str | None, out_dir: str, tag: str) -> ctypes.CDLL:
    """w4a8.c and its headers at git revision `rev` (None: the working tree), built in out_dir/tag."""
    from attn_model_ab import kernel_files

    from selfspec.kernels import build as kb
    from selfspec.kernels import w4a8

    cc = kb.compiler()
    if cc is None:
        sys.exit("w4a8_ab: no C compiler")
    d = os.path.join(out_dir, tag)
    os.makedirs(d)
    kernel_files(rev, ("w4a8", "w8a8", "lora8", "bf16"), d)
    lib = os.path.join(d, "w4a8.so")
    err = kb.compile_c(cc, os.path.join(d, "w4a8.c"), lib, kb.FLAGS)
    if err:
        sys.exit(f"w4a8_ab: {tag}: {err}")
    dll = ctypes.CDLL(lib)
    dll.w4a8_linear.argtypes, dll.w4a8_linear.restype = w4a8._ARGS, ctypes.c_int
    dll.w8a8_linear.argtypes, dll.w8a8_linear.restype = w4a8._ARGS8, ctypes.c_int
    return dll


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="the git revision whose w4a8.c is build A (default HEAD)")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 3, 4, 8, 16, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", action="store_true", help="the default model's whole forward (see above)")
    a = ap.parse_args()
    import torch

    from selfspec.kernels import w4a8

    torch.manual_seed(0)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as tmp:
        libs = {a.rev: build(a.rev, tmp, "a"), "working tree": build(None, tmp, "b")}
        if a.model:
            return model_forward(libs, a)
        ws = [w4a8.pack(torch.randn(n, k) * 0.05) for n, k in SHAPES]
        head = w4a8.pack8(torch.randn(*HEAD) * 0.05)
        out = {"command": "python benchmarks/w4a8_ab.py " + " ".join(sys.argv[1:]), "threads": a.threads, "rows": []}
        for M in a.rows:
            xs = {k: torch.randn(M, k).bfloat16() for k in {k for _, k in SHAPES}}
            ys = [torch.empty(M, n, dtype=torch.bfloat16) for n, _ in SHAPES]
            yh = torch.empty(M, HEAD[0], dtype=torch.bfloat16)
            best, bits = {}, {}
            for rep in range(a.repeats):
                for name in (list(libs) if rep % 2 == 0 else list(libs)[::-1]):
                    lib = libs[name]
                    t0 = time.perf_counter()
                    for _ in range(10):
                        for w, (n, k), y in zip(ws, SHAPES, ys):
                            lib.w4a8_linear(xs[k].data_ptr(), 1, M, k, w.packed.data_ptr(), n, y.data_ptr(), 1, a.threads)
                    t1 = time.perf_counter()
                    lib.w8a8_linear(xs[576].data_ptr(), 1, M, 576, head.packed.data_ptr(), head.scale.data_ptr(),
                                    HEAD[0], yh.data_ptr(), 1, a.threads)
                    t2 = time.perf_counter()
                    b = best.setdefault(name, [float("inf"), float("inf")])
                    b[0], b[1] = min(b[0], (t1 - t0) / 10), min(b[1], t2 - t1)
                    bits[name] = torch.cat([y.flatten() for y in ys] + [yh.flatten()]).view(torch.int16).clone()
            same = torch.equal(*bits.values())
            macs = sum(n * k for n, k in SHAPES) * M
            rec = {"rows": M, "same_bits": same, **{name: {"layer_us": round(b[0] * 1e6, 1), "layer_gmacs": round(
                macs / b[0] / 1e9, 1), "head_us": round(b[1] * 1e6, 1)} for name, b in best.items()}}
            out["rows"].append(rec)
            print(f"{M:3d} rows: " + "   ".join(f"{name}: layer {b[0] * 1e6:7.0f} us ({macs / b[0] / 1e9:5.1f} GMAC/s), "
                                               f"head {b[1] * 1e6:6.0f} us" for name, b in best.items())
                  + ("" if same else "   DIFFERENT BITS"), flush=True)
        print(json.dumps(out))
        if not all(r["same_bits"] for r in out["rows"]):
            sys.exit(1)


def model_forward(libs: dict, a) -> None:
    """The default model's forwards at each width with each build's w4a8_linear_lora (the one-call
    block's matmul since cd82e5b; an older revision has none: `lora_cost.py --rev` builds a whole
    block) in the one-call block (`attn_model_ab.widths`: the same timing and the logits compared;
    the head is the working tree's)."""
    import torch

    from attn_model_ab import widths

    from selfspec.kernels import block
    from selfspec.loading import load

    torch.set_num_threads(a.threads)
    model = load(weights="w4a8", progress=False)[0]
    if block._entry() is None:
        sys.exit("w4a8_ab --model: the one-call block is not built here")
    kernels = {}
    for name, lib in zip(("old", "new"), libs.values()):
        if not hasattr(lib, "w4a8_linear_lora"):
            sys.exit(f"w4a8_ab --model: {a.rev}'s w4a8.c predates w4a8_linear_lora (cd82e5b); "
                     "`benchmarks/lora_cost.py --rev` A/Bs a whole block")
        kernels[name] = block._Kernels.from_buffer_copy(block._state["kn"])
        kernels[name].linear = ctypes.cast(lib.w4a8_linear_lora, ctypes.c_void_p).value
    ours = block._state["kn"]
    try:
        widths(model, list(range(5, 69)), a.rows, kernels, a.repeats, "default", a.rev)
    finally:
        block._state["kn"] = ours


if __name__ == "__main__":
    main()
