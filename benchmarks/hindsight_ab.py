"""plan "auto" with and without hindsight (`engine/shadow.py`: lookup chains followed as the
row's tokens arrive, the calibration keyed by the row's run of chains borne out, the ledger told
what unaffordable bets would have won), against AR, in one process.

    python benchmarks/hindsight_ab.py --prompts tune --kind chat --temperature 0 --repeats 3
    python benchmarks/hindsight_ab.py --suite 1k --split tune --repeats 2

"without" is the same code with `Planner._shadow` and `Planner._follow_rest` made no-ops and one
calibration key per match length (what `auto` did before hindsight). Each arm keeps its own
planner across prompts (as the bench does); per prompt the arms run in rotating order, and the
first pass is a warm-up that is not counted. `--suite`: the long suite's prompts after the
bench's warm-up (8 tokens after the first 256 of the first prompt), greedy, 96 tokens, decode
time after the first token. Prints each arm's seconds, its ratio to AR, its plan histogram and
(at T = 0) whether its outputs equal AR's.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", choices=["tune", "bench"], default="tune",
                    help="benchmarks/tune_prompts.jsonl, or the default model's bench prompts (held out)")
    ap.add_argument("--kind", choices=["chat", "code"], help="only prompts of this kind")
    ap.add_argument("--suite", choices=["1k", "3k"], help="the long suite's prompts of this length instead")
    ap.add_argument("--split", choices=["tune", "held-out"], help="with --suite: only this split")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine import planner as planner_mod
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.loading import load
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_prompts, read_suite

    model, tok = load(progress=False)
    Planner = planner_mod.Planner
    shipped = (Planner._shadow, Planner._follow_rest, planner_mod.RUN_KEYS)
    bare = (lambda self, rnd, blocked: None, lambda self, r, n: None, 0)
    stored: dict[str, dict] = {"with": {}, "without": {}}

    def use(arm: str) -> None:
        Planner._shadow, Planner._follow_rest, planner_mod.RUN_KEYS = shipped if arm == "with" else bare
        model.__dict__["_selfspec_planners"] = stored[arm]

    if a.suite:
        prompts = [p for p in read_suite("long") if p["length"] == a.suite and a.split in (None, p["split"])]
        tokens, warm = 96, True
    else:
        path = ("benchmarks/tune_prompts.jsonl" if a.prompts == "tune"
                else os.path.join(default_model_dir(), "prompts.jsonl"))
        prompts = [p for p in read_prompts(path) if a.kind is None or a.kind in p["id"]][:8]
        tokens, warm = 128, False
    enc = [encode_prompt(tok, p["prompt"]) for p in prompts]
    arms = ["ar", "with", "without"]
    if warm:
        for arm in arms[1:]:
            use(arm)
            for _ in Decoder(model, [enc[0][:256]], DecodeConfig(max_new_tokens=8), eos_token_id=[]):
                pass

    def run(arm: str, i: int) -> tuple[float, list, Counter]:
        if arm != "ar":
            use(arm)
        cfg = DecodeConfig(mode="ar" if arm == "ar" else "auto", max_new_tokens=tokens, temperature=a.temperature)
        d = Decoder(model, [enc[i]], cfg, seeds=[i], **({"eos_token_id": []} if warm else {}))
        t0, first = time.perf_counter(), None
        for n, _ in enumerate(d):
            if n == 0:
                first = time.perf_counter()
        dt = time.perf_counter() - (first if warm else t0)
        return dt, d.outputs[0], Counter(d.stats[0].plan_hist)

    seconds, hists, outs = Counter(), {arm: Counter() for arm in arms}, {}
    for rep in range(a.repeats + (0 if warm else 1)):
        counted = warm or rep > 0
        for i in range(len(enc)):
            k = (i + rep) % 3
            for arm in arms[k:] + arms[:k]:
                dt, out, hist = run(arm, i)
                if counted:
                    seconds[arm] += dt
                    hists[arm] += hist
                    outs.setdefault((arm, i), out)
    same = {arm: all(outs[(arm, i)] == outs[("ar", i)] for i in range(len(enc))) for arm in arms[1:]}
    what = f"long suite {a.suite}" + (f" {a.split}" if a.split else "") if a.suite else f"{a.prompts} {a.kind or 'all'}"
    print(f"{what}, T = {a.temperature:g}, {len(enc)} prompts x {a.repeats}: " +
          ", ".join(f"{n} {seconds[n]:.2f} s ({seconds['ar'] / seconds[n]:.3f}x AR)" for n in arms) +
          ("" if a.temperature else f"; = AR: {same}"))
    for arm in arms[1:]:
        print(f"  {arm}: {dict(hists[arm].most_common(6))}")


if __name__ == "__main__":
    sys.exit(main())
