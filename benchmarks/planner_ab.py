"""plan "auto" with the round-cost rules of a git revision (`engine/round_costs.py` there: how the
planner learns what each kind of round costs) against the working tree's, or with two cost-model
files against each other, in one process.

    python benchmarks/planner_ab.py --rev f3e0c2c --temperature 0 --repeats 3        # the bench's prompts
    python benchmarks/planner_ab.py --rev f3e0c2c --warm --length 1k --limit 4       # after a warm-up
    python benchmarks/planner_ab.py --profiles OLD.json NEW.json --kind code         # two cost models
    python benchmarks/planner_ab.py --profiles OLD.json NEW.json --warm --length 3k --split tune

Default: AR and both rules' `auto` on the default model's first 8 prompts (`--kind`: of that kind;
128 new tokens, seed i for prompt i), mirrored order (A B C C B A) `--repeats` times; prints each
one's seconds, its ratio to AR and its plan histogram. `--warm`: each rule gets a fresh planner
that first decodes 8 tokens after the first 256 tokens of the prompt (the bench's warm-up) and
then the long suite's prompt, greedy, 96 tokens; prints tau and the decode time after the first
token (AR's too), and the decode totals. At T = 0 the outputs must equal AR's (checked).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace

RULES = ("_observe_time", "_scale", "forecast_drag")  # what a revision's round-cost rules replace


def rules_at(rev: str) -> dict:
    """`RoundCosts`' learning and pricing methods as `engine/round_costs.py` had them at `rev`."""
    from selfspec.engine import round_costs

    root = os.path.dirname(os.path.dirname(os.path.abspath(round_costs.__file__)))
    src = subprocess.run(["git", "show", f"{rev}:selfspec/engine/round_costs.py"], capture_output=True, text=True,
                         check=True, cwd=root).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(f"round_costs_{rev}", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return {k: getattr(mod.RoundCosts, k) for k in RULES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    old = ap.add_mutually_exclusive_group(required=True)
    old.add_argument("--rev", help="the revision whose round-cost rules run as 'old'")
    old.add_argument("--profiles", nargs=2, metavar=("OLD", "NEW"), help="cost-model files for 'old' and 'new' "
                     "(both with the working tree's rules)")
    ap.add_argument("--kind", choices=["chat", "code"], help="only this kind of the default prompts")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warm", action="store_true", help="the long suite's prompts after the bench's warm-up")
    ap.add_argument("--length", default="1k", choices=["1k", "3k"])
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--split", choices=["tune", "held-out"], help="only this half of the long suite (--warm)")
    a = ap.parse_args()
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine.cost import CostModel
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.engine.planner import Planner
    from selfspec.loading import load
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_prompts, read_suite

    here = {k: getattr(Planner, k) for k in RULES}
    ways = {"old": rules_at(a.rev) if a.rev else here, "new": here}
    profile = dict(zip(("old", "new"), [CostModel.load(f) for f in a.profiles])) if a.profiles else {}
    model, tok = load(progress=False)

    def use(name: str, stored: dict | None = None) -> None:
        """The rule `name`, with its own stored planners (`engine.planner_store`; none: a fresh start)."""
        for k, f in ways[name].items():
            setattr(Planner, k, f)
        model.__dict__["_selfspec_planners"] = dict(stored or {})

    def kept() -> dict:
        return dict(model.__dict__.get("_selfspec_planners", {}))

    if a.warm:
        prompts = [p for p in read_suite("long") if p["length"] == a.length and a.split in (None, p["split"])][: a.limit]
        cfg = DecodeConfig(mode="auto", max_new_tokens=96)
        decode = Counter()
        for p in prompts:
            ids = encode_prompt(tok, p["prompt"])
            line, ref = [], None
            for name in ("ar", "old", "new"):
                if name != "ar":
                    use(name)
                    for _ in Decoder(model, [ids[:256]], replace(cfg, max_new_tokens=8), eos_token_id=[],
                                     profile=profile.get(name)):
                        pass
                d = Decoder(model, [ids], DecodeConfig(mode="ar", max_new_tokens=96) if name == "ar" else cfg, eos_token_id=[],
                            profile=profile.get(name))
                first = None
                for n, _ in enumerate(d):
                    if n == 0:
                        first = time.perf_counter()
                dt, st = time.perf_counter() - first, d.stats[0]
                decode[name] += dt
                ref = d.outputs[0] if name == "ar" else ref
                tau = sum(st.accept_lengths) / len(st.accept_lengths)
                line.append(f"{name} tau {tau:.2f} decode {dt:.3f} s" + ("" if name == "ar" else
                                                                       f" (= AR: {d.outputs[0] == ref})"))
            print(f"{p['id']}: " + "; ".join(line), flush=True)
        print(f"decode in all: AR {decode['ar']:.3f} s, old {decode['ar'] / decode['old']:.3f}x AR, "
              f"new {decode['ar'] / decode['new']:.3f}x AR")
        return

    prompts = [p for p in read_prompts(os.path.join(default_model_dir(), "prompts.jsonl"))
               if a.kind is None or p["id"].startswith(a.kind)][:8]
    enc = [encode_prompt(tok, p["prompt"]) for p in prompts]

    def run(name: str) -> tuple[float, list, Counter]:
        mode = "ar" if name == "ar" else "auto"
        tot, outs, hist = 0.0, [], Counter()
        for i, ids in enumerate(enc):
            d = Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=128, temperature=a.temperature), seeds=[i],
                        profile=profile.get(name))
            t0 = time.perf_counter()
            for _ in d:
                pass
            tot += time.perf_counter() - t0
            outs.append(d.outputs[0])
            hist += Counter(d.stats[0].plan_hist)
        return tot, outs, hist

    names, planners = ["ar", "old", "new"], {}
    seconds, outs, hists = Counter(), {}, {}
    for name in names:  # warm-up: tables, allocator, and each rule's planner learns its first rounds
        if name != "ar":
            use(name)
            run(name)
            planners[name] = kept()
    for r in range(a.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            if name != "ar":
                use(name, planners[name])
            dt, o, h = run(name)
            if name != "ar":
                planners[name] = kept()
            seconds[name] += dt
            outs.setdefault(name, o)
            hists[name] = hists.get(name, Counter()) + h
    print(f"T = {a.temperature:g}, {len(enc)} prompts x {a.repeats}: " +
          ", ".join(f"{n} {seconds[n]:.2f} s ({seconds['ar'] / seconds[n]:.3f}x AR)" for n in names) +
          ("" if a.temperature else f"; = AR: old {outs['old'] == outs['ar']}, new {outs['new'] == outs['ar']}"))
    for n in ("old", "new"):
        print(f"  {n}: {dict(hists[n].most_common(6))}")


if __name__ == "__main__":
    sys.exit(main())
