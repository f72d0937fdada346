"""A long context: time to first token and decode tokens/s of AR and `auto` over a text cut to N tokens.

    python benchmarks/long_context.py --file /usr/lib/python3.11/argparse.py --tokens 1000 3000

For each N, the file's first N tokens are the prompt (a source file: "continue this code"); AR and
`auto` each decode `--new` greedy tokens (eos off) in mirrored pairs (A B, B A, ... `--pairs`),
timing the prefill (time to the first token) and the decode after it separately; greedy outputs
must agree. Default model and weight format (`selfspec.load()`). Prints one JSON record with the
command. The text is whatever you point it at: nothing is shipped with the project.
"""

import argparse
import json
import os
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--file", required=True, help="a long text file (e.g. a source file)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    import selfspec
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig

    with open(a.file, encoding="utf-8") as f:
        text = f.read()
    model, tok = selfspec.load(a.model, progress=False)
    ids_all = tok.encode(text)
    cfgs = {"ar": DecodeConfig(mode="ar", max_new_tokens=a.new), "auto": DecodeConfig(max_new_tokens=a.new)}
    out = []
    for n in a.tokens:
        if n > len(ids_all):
            raise SystemExit(f"error: {a.file} has {len(ids_all)} tokens, fewer than {n}")
        ids = ids_all[:n]
        rows = {k: {"ttft_s": [], "decode_tokens": 0, "decode_s": 0.0, "plan_hist": {}, "ids": None} for k in cfgs}
        for p in range(a.pairs):
            for name in (["ar", "auto"] if p % 2 == 0 else ["auto", "ar"]):
                dec = Decoder(model, [ids], cfgs[name], eos_token_id=[])
                t0, first = time.perf_counter(), None
                for _ in dec:
                    first = first or time.perf_counter()
                end = time.perf_counter()
                r, st = rows[name], dec.stats[0]
                r["ttft_s"].append(round(first - t0, 3))
                r["decode_tokens"] += st.new_tokens - 1
                r["decode_s"] += end - first
                for k, v in st.plan_hist.items():
                    r["plan_hist"][k] = r["plan_hist"].get(k, 0) + v
                r["ids"] = r["ids"] or dec.outputs[0]
        rec = {"context_tokens": n, "greedy_equal": rows["ar"]["ids"] == rows["auto"]["ids"]}
        for k, r in rows.items():
            rec[k] = {"ttft_s": r["ttft_s"], "decode_tokens_per_second": round(r["decode_tokens"] / r["decode_s"], 2),
                      "plan_hist": r["plan_hist"]}
        rec["auto_vs_ar_decode"] = round(rec["auto"]["decode_tokens_per_second"] / rec["ar"]["decode_tokens_per_second"], 3)
        out.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
    print(json.dumps({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "file": a.file,
                      "new_tokens": a.new, "pairs": a.pairs, "results": out}, indent=1))


if __name__ == "__main__":
    main()
