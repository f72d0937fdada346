"""AR decode with two builds of the exact attention's kernel (`attn16.c` and its headers) in one
process: the committed one at a git revision and the working tree's, swapped in the one-call layer
block between generations (mirrored A B B A order), on the long suite's real prompts.

    python benchmarks/attn_model_ab.py --rev HEAD~1 --limit 2 --repeats 2
    python benchmarks/attn_model_ab.py --rev HEAD~1 --mode lookup --length 3k
    python benchmarks/attn_model_ab.py --rev HEAD~1 --length 3k --limit 1 --widths 1 2 4 8 16
    python benchmarks/attn_model_ab.py --rev HEAD~1 --file /usr/lib/python3.11/argparse.py --tokens 64 300 --widths 1 4 16

Builds whose numbers are the same (a faster kernel for the same exact sums) must give the same
tokens and logits; the script checks it unless --changed-numerics (a build that changes a rounding
on purpose, e.g. the softmax's exponential) says they may differ. Prints per prompt the decode time per token (first token excluded) of each build, the fastest of
`--repeats`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time

import torch

from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.kernels import block, build
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_suite


def kernel_files(rev: str | None, prefixes: tuple[str, ...], out_dir: str) -> None:
    """The kernel sources (`selfspec/kernels/<prefix>*.c / .h`) of git revision `rev` (None: the
    working tree) written into `out_dir`: a kernel built there includes its own revision's headers."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=build.HERE).stdout.strip()
    if rev is None:
        names = [n for n in os.listdir(build.HERE) if n.startswith(prefixes) and n.endswith((".c", ".h"))]
    else:
        listed = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:selfspec/kernels"], capture_output=True,
                                text=True, cwd=root)
        if listed.returncode:
            raise SystemExit(f"git ls-tree {rev}:selfspec/kernels failed: {listed.stderr.strip()}")
        names = [n for n in listed.stdout.split() if n.startswith(prefixes) and n.endswith((".c", ".h"))]
    for n in names:
        if rev is None:
            with open(os.path.join(build.HERE, n), "rb") as f:
                data = f.read()
        else:
            data = subprocess.run(["git", "show", f"{rev}:selfspec/kernels/{n}"], capture_output=True, cwd=root,
                                  check=True).stdout
        with open(os.path.join(out_dir, n), "wb") as f:
            f.write(data)


def old_direct(rev: str) -> ctypes.CDLL:
    """attn16.c at `rev`, with the headers of that revision, built to a temporary library."""
    d = tempfile.mkdtemp(prefix="attn_ab_")
    kernel_files(rev, ("attn16", "bf16"), d)
    out = os.path.join(d, "attn16_old.so")
    err = build.compile_c(build.compiler(), os.path.join(d, "attn16.c"), out, build.FLAGS)
    if err:
        raise SystemExit(f"building attn16.c at {rev} failed: {err}")
    return ctypes.CDLL(out)


def widths(model, ids, ws, kernels, repeats, name, rev, changed: bool = False) -> None:
    """The fastest of repeats x 5 forwards of each width (a causal block of new tokens after the
    prompt, as a verification round) with each build, alternating; outputs compared."""
    from selfspec.engine.batch_forward import BatchForward

    bf = BatchForward.of(model)
    cache = bf.new_cache(1, len(ids) + max(ws) + 8)
    bf(torch.tensor([ids]), torch.arange(len(ids))[None], cache, slice(0, 1), causal=True)
    cache.set_length(0, len(ids))
    best, outs = {}, {}
    for rep in range(repeats):
        for kn in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            block._state["kn"] = kernels[kn]
            for w in ws:
                toks, pos = torch.tensor([ids[-w:]]), torch.arange(len(ids), len(ids) + w)[None]
                mask = torch.full((w, w), float("-inf")).triu(1)[None]
                for _ in range(5):
                    t0 = time.perf_counter()
                    out = bf.logits(bf(toks, pos, cache, slice(0, 1), block=mask)[0])
                    dt = time.perf_counter() - t0
                    best[kn, w] = min(best.get((kn, w), float("inf")), dt)
                outs.setdefault((kn, w), out)
    block._state["kn"] = kernels["new"]
    for w in ws:
        same = torch.equal(outs["old", w], outs["new", w])
        print(f"{name:8s} {len(ids):5d} tokens  width {w:2d}: {rev} {best['old', w] * 1e3:.2f} ms  working tree "
              f"{best['new', w] * 1e3:.2f} ms  ({best['old', w] / best['new', w]:.2f}x)  same logits: {same}", flush=True)
        if not same and not changed:
            raise SystemExit("the builds' logits differ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--limit", type=int, default=2, help="prompts per length (the suite's first)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--mode", default="ar", help="a decoding mode (lookup: wide verification rounds)")
    ap.add_argument("--length", choices=["1k", "3k"], default=None, help="only the prompts of this length")
    ap.add_argument("--changed-numerics", action="store_true",
                    help="the builds' numbers differ on purpose (report, do not require, equal outputs)")
    ap.add_argument("--widths", type=int, nargs="*", default=None,
                    help="time one forward of each width after the prompt instead of generating")
    ap.add_argument("--file", default=None,
                    help="prompts from this text file instead (its first --tokens tokens; short contexts)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64])
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load(progress=False)
    if block._entry() is None:
        raise SystemExit("the one-call layer block is not built here")
    new = block._state["kn"]
    old = block._Kernels.from_buffer_copy(new)
    lib = old_direct(a.rev)
    old.direct = ctypes.cast(lib.attn16_direct, ctypes.c_void_p).value
    kernels = {"old": old, "new": new}
    cfg = DecodeConfig(mode=a.mode, max_new_tokens=a.max_new_tokens)
    rows = []
    if a.file is not None:
        with open(a.file) as f:
            text_ids = tok.encode(f.read())
        prompts = [{"id": f"file{n}", "ids": text_ids[:n]} for n in a.tokens]
    else:
        prompts = read_suite("long", a.limit)
    for p in prompts:
        if a.length and p.get("length") != a.length:
            continue
        ids = p["ids"] if "ids" in p else encode_prompt(tok, p["prompt"])
        if a.widths:
            widths(model, ids, a.widths, kernels, a.repeats, p.get("id", "?"), a.rev, a.changed_numerics)
            continue
        per, outs = {"old": [], "new": []}, {}
        for rep in range(a.repeats):
            for name in ("old", "new") if rep % 2 == 0 else ("new", "old"):
                block._state["kn"] = kernels[name]
                dec = Decoder(model, [ids], cfg, eos_token_id=[])  # every run decodes max_new_tokens
                t0, n0 = None, 0
                for _ in dec:
                    if t0 is None:
                        t0, n0 = time.perf_counter(), len(dec.outputs[0])
                per[name].append((time.perf_counter() - t0) / max(1, len(dec.outputs[0]) - n0))
                outs.setdefault(name, list(dec.outputs[0]))
        block._state["kn"] = new
        same = outs["old"] == outs["new"]
        o, n = min(per["old"]) * 1e3, min(per["new"]) * 1e3
        rows.append((p.get("id", "?"), len(ids), o, n, same))
        print(f"{p.get('id', '?'):8s} {len(ids):5d} tokens  decode ms/token: {a.rev} {o:.2f}  working tree {n:.2f}"
              f"  ({o / n:.2f}x)  same tokens: {same}", flush=True)
    if not all(r[4] for r in rows) and not a.changed_numerics:
        raise SystemExit("the builds' outputs differ")


if __name__ == "__main__":
    main()
