"""The w4a8 kernel's AMX tiles against its vector loops in one process (`kernels.w4a8.amx`), on
the default model: a prompt's prefill, and forwards of a causal block of new tokens after it.

    python benchmarks/amx_ab.py --prefill 1000 3000 --widths 1 8 16 32 64 --repeats 4

Both paths give the same bits (checked: the prefill's first token and each width's logits), so
only the time differs. They alternate inside every repeat (A B, then B A) and the fastest repeat
of each is kept: this machine's speed drifts by 10-20% within minutes. The prompt is the first
tokens of Python's argparse.py, as `benchmarks/long_context.py` uses. Prints one line per
measurement and a JSON record with the command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", nargs="*", type=int, default=[1000], help="prompt lengths to prefill")
    ap.add_argument("--widths", nargs="*", type=int, default=[1, 8, 16, 32, 64])
    ap.add_argument("--cached", type=int, default=64, help="tokens before the widths' blocks")
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    from selfspec.engine.batch_forward import BatchForward
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.kernels import w4a8
    from selfspec.loading import load

    if not w4a8.amx():
        raise SystemExit("no AMX tiles here (the CPU lacks them, the OS refuses them, or the kernel did not build)")
    model, tok = load(None, progress=False)
    with open(argparse.__file__) as f:
        text_ids = tok.encode(f.read())
    records = []

    def ab(label, run, inner=1):  # the fastest of repeats x inner calls of each path
        best, outs = {}, {}
        for rep in range(a.repeats):
            for on in (True, False) if rep % 2 == 0 else (False, True):
                w4a8.amx(on)
                for _ in range(inner):
                    t0 = time.perf_counter()
                    out = run()
                    best[on] = min(best.get(on, float("inf")), time.perf_counter() - t0)
                outs.setdefault(on, out)
        w4a8.amx(True)
        same = torch.equal(outs[True], outs[False])
        print(f"{label}: vector loops {best[False] * 1e3:.2f} ms, AMX tiles {best[True] * 1e3:.2f} ms "
              f"({best[False] / best[True]:.3f}x), same: {same}", flush=True)
        records.append({"what": label, "vector_ms": round(best[False] * 1e3, 3), "amx_ms": round(best[True] * 1e3, 3),
                        "same": same})
        if not same:
            raise SystemExit("the two paths' outputs differ")

    for n in a.prefill:
        ids = text_ids[:n]

        def prefill():
            dec = Decoder(model, [ids], DecodeConfig(mode="ar", max_new_tokens=1), eos_token_id=[])
            for _ in dec:
                pass
            return torch.tensor(dec.outputs[0])
        ab(f"prefill of {len(ids)} tokens", prefill)
    if a.widths:
        ids = text_ids[: a.cached]
        bf = BatchForward.of(model)
        cache = bf.new_cache(1, len(ids) + max(a.widths) + 8)
        bf(torch.tensor([ids]), torch.arange(len(ids))[None], cache, slice(0, 1), causal=True)
        cache.set_length(0, len(ids))
        for w in a.widths:
            toks = torch.tensor([text_ids[a.cached : a.cached + w]])
            pos = torch.arange(len(ids), len(ids) + w)[None]
            mask = torch.full((w, w), float("-inf")).triu(1)[None]

            def forward():
                return bf.logits(bf(toks, pos, cache, slice(0, 1), block=mask)[0])
            ab(f"forward of width {w} after {len(ids)} tokens", forward, inner=5)
    print(json.dumps({"command": "python " + " ".join(sys.argv), "threads": torch.get_num_threads(),
                      "records": records}))


if __name__ == "__main__":
    main()
