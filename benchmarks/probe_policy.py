"""How plan "auto" bets on marginals, A/B in one process: the probe and prefill-group policy of
this checkout ("spaced") against the one before it ("every-8": a probe every 8 AR-like rounds
whatever it costs, and a mask group on every prefill), with AR as the yardstick.

    python benchmarks/probe_policy.py [--limit 8] [--tokens 64] [--reps 3] [--weights int4]

For each temperature (0 and 1) it runs, prompt by prompt and repetition by repetition, AR, auto
under the old policy and auto under the new one, interleaved so that a machine that speeds up
or slows down during the run moves all three alike, and prints tokens/s and the ratio to AR.
The old policy is restored by switching the planner's own knobs (`PROBE_SHARE`, and
`marginals_at_prefill` answering yes), not by a copy of old code. Run it alone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--weights", default=None)
    a = ap.parse_args(argv)

    import selfspec
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine import planner
    from selfspec.tools.bench import read_prompts

    spaced = (planner.PROBE_SHARE, planner.Planner.marginals_at_prefill)
    policies = {"every-8": (1e18, lambda *args: True), "spaced": spaced}
    model, tok = selfspec.load(weights=a.weights, progress=False)
    prompts = [p["prompt"] for p in read_prompts(os.path.join(default_model_dir(), "prompts.jsonl"))[: a.limit]]
    args = sys.argv[1:] if argv is None else list(argv)
    report = {"command": " ".join(["python benchmarks/probe_policy.py", *args]), "rows": {}}
    for temperature in (0.0, 1.0):
        seconds, tokens = {}, {}
        for rep in range(a.reps):
            for prompt in prompts:
                for name in ("ar", "every-8", "spaced"):
                    planner.PROBE_SHARE, planner.Planner.marginals_at_prefill = policies.get(name, spaced)
                    kw = {"mode": "ar"} if name == "ar" else {}
                    t0 = time.perf_counter()
                    out = selfspec.generate(model, tok, prompt, max_new_tokens=a.tokens, temperature=temperature,
                                            seed=rep, **kw)
                    seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
                    tokens[name] = tokens.get(name, 0) + len(out.token_ids)
        planner.PROBE_SHARE, planner.Planner.marginals_at_prefill = spaced
        ar = tokens["ar"] / seconds["ar"]
        for name in seconds:
            tps = tokens[name] / seconds[name]
            report["rows"][f"T={temperature:g} {name}"] = {"tokens_per_second": round(tps, 1),
                                                           "vs_ar": round(tps / ar, 3)}
    for k, v in report["rows"].items():
        print(f"{k:16s} {v['tokens_per_second']:7.1f} tok/s  {v['vs_ar']:.3f}x AR")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
