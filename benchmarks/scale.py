"""Where real NLD models would land on this CPU: the w4a8 matmuls of a whole forward at the shapes
of the default model, NLD-3B and NLD-8B, by round width.

    python benchmarks/scale.py                      # all three shapes, widths 1..64
    python benchmarks/scale.py --models nld-3b --widths 1 8 16

Per layer: fused q/k/v [(heads + 2 kv heads) x head_dim, hidden], o [hidden, heads x head_dim],
fused gate/up [2 x ffn, hidden], down [hidden, ffn]; then the head [vocab, hidden] at 8 bits,
as the w4a8 format lays out the default model. Weights are random bytes with a fixed valid
scale (the kernel's speed does not depend on the values), every layer its own buffer, so the
weights stream from memory as a real forward's do. Times the matmuls only (no attention, norms or
RoPE: on the default model they are ~60% of a width-1 forward, on an 8B a few %), fastest of
`--repeats`. Reports f(w) / f(1), the bytes read per width-1 forward over its time (GB/s, against
a plain memory copy's), and what a round of width w would give at the paper's acceptance
(tau 5.6 at one-pass budget 32: a hypothetical acceptance, not one measured here). Prints one
JSON record with the command.
"""

import argparse
import json
import sys
import time

SHAPES = {  # hidden, layers, ffn, heads, kv heads, head dim, vocab
    "smollm2-135m": (576, 30, 1536, 9, 3, 64, 49152),
    "nld-3b": (3072, 26, 9216, 32, 8, 128, 131072),
    "nld-8b": (4096, 34, 14336, 32, 8, 128, 131072),
}
PAPER_TAU = 5.6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--widths", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    import torch

    from selfspec.kernels import w4a8

    if w4a8.kernel() is None:
        raise SystemExit("error: the w4a8 C kernel is not available here; the fallback is not worth timing")
    big = torch.empty(512 * 2**20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(big).fill_(0)  # touched: the copy times no page faults
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(big)
    copy_gbs = 3 * 2 * big.numel() / (time.perf_counter() - t0) / 1e9  # read + write
    del big, dst
    out = {"command": "python benchmarks/scale.py " + " ".join(sys.argv[1:]), "threads": torch.get_num_threads(),
           "isa": w4a8.isa(), "copy_GBps": round(copy_gbs, 1), "models": {}}
    for name in a.models:
        hid, layers, ffn, heads, kv, hd, vocab = SHAPES[name]
        mats = [((heads + 2 * kv) * hd, hid), (hid, heads * hd), (2 * ffn, hid), (hid, ffn)]
        weights, nbytes = [], 0
        for _ in range(layers):
            for n, k in mats:
                packed = torch.randint(0, 256, (n // 16, k // 32, w4a8.TILE_BYTES), dtype=torch.uint8)
                packed[..., 256:] = torch.tensor([0x00, 0x20], dtype=torch.uint8).repeat(32)  # fp16 2^-7
                weights.append(w4a8.W4A8Weight(packed, (n, k)))
                nbytes += packed.numel()
        head = torch.randint(0, 256, ((vocab + 15) // 16, hid // 32, w4a8.TILE_BYTES8), dtype=torch.uint8)
        weights.append(w4a8.W8A8Weight(head, torch.full((vocab,), 1e-3), (vocab, hid)))
        nbytes += head.numel() + 4 * vocab
        macs = sum(w.shape[0] * w.shape[1] for w in weights)
        rec = {"hidden": hid, "layers": layers, "weight_GB": round(nbytes / 1e9, 2), "f": {}}
        for w in a.widths:
            xs = {k: torch.randn(w, k).to(torch.bfloat16) for k in {m[1] for m in mats} | {hid}}
            best = float("inf")
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                for wt in weights:
                    wt(xs[wt.shape[1]])
                best = min(best, time.perf_counter() - t0)
            rec["f"][w] = best
            print(f"{name} width {w}: {best * 1e3:.1f} ms", file=sys.stderr, flush=True)
        f1 = rec["f"][a.widths[0]]
        rec["ratio"] = {w: round(s / f1, 2) for w, s in rec["f"].items()}
        rec["GBps_at_width1"] = round(nbytes / f1 / 1e9, 1)
        rec["GMACps_at_widest"] = round(macs * a.widths[-1] / rec["f"][a.widths[-1]] / 1e9, 1)
        rec["ar_tok_s_matmuls"] = round(1 / f1, 1)
        rec["tok_s_at_tau_5.6"] = {w: round(PAPER_TAU / s, 1) for w, s in rec["f"].items() if w >= 8}
        rec["f"] = {w: round(s * 1e3, 2) for w, s in rec["f"].items()}
        out["models"][name] = rec
        del weights
    print(json.dumps(out))


if __name__ == "__main__":
    main()
