"""Quality at a long context: each exact weight format's top-1 agreement with fp32 and mean
KL(fp32 || format) per position, teacher-forced over the first N tokens of the long suite's
prompts, with the exact attention's kernel as built at a git revision and as in the working tree
(every C entry point of `attn16.c` swapped, in one process).

    python benchmarks/long_kl.py --rev HEAD~1 --tokens 1500 --formats w4a8 int4

For a change to the attention's numbers (a rounding, the softmax's exponential): how much it moves
the quality that the weight formats' table reports. Prints a Markdown table and a JSON record.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attn_model_ab import old_direct  # noqa: E402

from selfspec.engine.formats import _logits, clone, set_weights  # noqa: E402
from selfspec.kernels import attn16, block  # noqa: E402
from selfspec.loading import load  # noqa: E402
from selfspec.streaming import encode_prompt  # noqa: E402
from selfspec.tools.bench_prompts import read_suite  # noqa: E402


def use(lib, kn, real_fn) -> None:
    """Route attn16's C entry points (Python-level and the layer block's) to `lib`."""
    fns = {}

    def fn(name: str):
        if name not in fns:
            f, ours = getattr(lib, name), real_fn(name)
            f.argtypes, f.restype = ours.argtypes, ours.restype
            fns[name] = f
        return fns[name]

    attn16._fn = fn
    block._state["kn"] = kn


def agreement_kl(model, texts: list, refs: list) -> dict:
    """`model`'s top-1 agreement with the reference log-probabilities `refs` (one [n, V] per text of
    token ids in `texts`) and its mean KL(ref || model) per position, teacher-forced."""
    agree, kl, n = 0.0, 0.0, 0
    for ids, lp in zip(texts, refs):
        lq = _logits(model, torch.tensor(ids)).log_softmax(-1)
        agree += float((lp.argmax(-1) == lq.argmax(-1)).float().sum())
        kl += float((lp.exp() * (lp - lq)).sum(-1).sum())
        n += len(ids)
    return {"agreement": round(agree / n, 5), "kl": round(kl / n, 6), "positions": n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--prompts", type=int, default=2, help="the suite's first N prompts of ~3,000 tokens")
    ap.add_argument("--formats", nargs="+", default=["w4a8", "int4"])
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load(weights="fp32", progress=False)
    texts = [encode_prompt(tok, p["prompt"])[: a.tokens] for p in read_suite("long") if p["length"] == "3k"]
    texts = texts[: a.prompts]
    refs = [_logits(model, torch.tensor(ids)).log_softmax(-1) for ids in texts]
    real_fn = attn16._fn
    block._entry()
    new_kn = block._state["kn"]
    old_kn = block._Kernels.from_buffer_copy(new_kn)
    lib = old_direct(a.rev)
    old_kn.direct = ctypes.cast(lib.attn16_direct, ctypes.c_void_p).value
    rows = []
    for fmt in a.formats:
        m = set_weights(clone(model), fmt)
        for name in ("old", "new"):
            if name == "old":
                use(lib, old_kn, real_fn)
            else:
                attn16._fn, block._state["kn"] = real_fn, new_kn
            rows.append({"weights": fmt, "build": a.rev if name == "old" else "working tree",
                         **agreement_kl(m, texts, refs)})
        attn16._fn, block._state["kn"] = real_fn, new_kn
    print("| weights | attention build | top-1 agreement with fp32 | mean KL(fp32 || format) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['build']} | {r['agreement']:.4f} | {r['kl']:.6f} |")
    print(json.dumps({"command": "python benchmarks/long_kl.py " + " ".join(sys.argv[1:]), "rows": rows}))


if __name__ == "__main__":
    main()
