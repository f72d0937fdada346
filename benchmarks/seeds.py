"""Reproducible vs independent sampling on the held-out prompts: tau per mode at T = 1, and whether
the same seed gives the same tokens (across modes, against AR, and in a batch).

    python benchmarks/seeds.py [--weights int4] [--limit 8] [--tokens 64] [--temperature 1.0] [--top-p 1.0]
    python benchmarks/seeds.py --samplings independent --modes auto     # some rows only (e.g. to finish a run)

For each sampling scheme and mode (ar, lookup, linear and PRESTO budget 32 under both schedules,
plan auto): tau and tokens/s over the prompts with seed = prompt index; with reproducible
sampling also the share of prompts whose tokens equal AR's with that seed, alone and in a batch
of 4. Prints one JSON object (with the command) and a Markdown table. Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

MODES = {
    "ar": dict(mode="ar"),
    "lookup": dict(mode="lookup"),
    "linear/two-pass": dict(mode="linear", schedule="two-pass"),
    "linear/one-pass": dict(mode="linear", schedule="one-pass"),
    "presto/two-pass/N=32": dict(mode="presto", schedule="two-pass", budget=32),
    "presto/one-pass/N=32": dict(mode="presto", schedule="one-pass", budget=32),
    "auto": dict(mode="auto"),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=None)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--samplings", nargs="+", choices=["reproducible", "independent"],
                    default=["reproducible", "independent"])
    a = ap.parse_args(argv)

    import torch

    import selfspec
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.engine.stats import Stats
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench import read_prompts

    torch.set_num_threads(2)
    model, tok = selfspec.load(weights=a.weights)
    prompts = [encode_prompt(tok, p["prompt"]) for p in read_prompts(os.path.join(default_model_dir(),
                                                                                  "prompts.jsonl"))[: a.limit]]
    seeds = list(range(len(prompts)))

    def run(mode, sampling, batch_size=1):
        cfg = DecodeConfig(max_new_tokens=a.tokens, temperature=a.temperature, top_p=a.top_p, sampling=sampling,
                           **MODES[mode])
        t0 = time.perf_counter()
        dec = Decoder(model, prompts, cfg, eos_token_id=[], seeds=seeds, batch_size=batch_size)
        for _ in dec:
            pass
        return dec.outputs, Stats.total(dec.stats), time.perf_counter() - t0

    report = {"command": "python benchmarks/seeds.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "weights": a.weights, "rows": {}}
    ar_out = {}
    for sampling in a.samplings:
        for mode in a.modes:
            outs, st, sec = run(mode, sampling)
            if mode == "ar":
                ar_out[sampling] = outs
            row = {"tau": round(st.tau, 3), "tokens_per_second": round(st.new_tokens / sec, 1)}
            if sampling in ar_out:  # the AR rows with this sampling ran first
                row["equal_to_ar"] = sum(o == r for o, r in zip(outs, ar_out[sampling]))
            if sampling == "reproducible" and mode != "ar" and sampling in ar_out:
                row["equal_to_ar_in_a_batch_of_4"] = sum(o == r for o, r in zip(run(mode, sampling, 4)[0],
                                                                                 ar_out[sampling]))
            report["rows"][f"{sampling}/{mode}"] = row
            print(sampling, mode, row, file=sys.stderr)
    lines = ["| mode | tau independent | tau reproducible | ratio | tok/s independent | tok/s reproducible | "
             "same tokens as AR (alone / batch of 4) |", "|" + "---|" * 7]
    for mode in a.modes:
        i, r = report["rows"].get(f"independent/{mode}"), report["rows"].get(f"reproducible/{mode}")
        if i is None or r is None or "equal_to_ar" not in r:  # a partial run: the JSON has its rows
            continue
        lines.append(f"| {mode} | {i['tau']:.2f} | {r['tau']:.2f} | {r['tau'] / i['tau']:.2f} | "
                     f"{i['tokens_per_second']:.1f} | {r['tokens_per_second']:.1f} | {r['equal_to_ar']}/{len(prompts)}"
                     f" / {r.get('equal_to_ar_in_a_batch_of_4', len(prompts))}/{len(prompts)} |")
    print("\n".join(lines))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
