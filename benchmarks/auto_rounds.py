"""Where `auto`'s time goes against AR's, by kind of round, in one process (mirrored A B B A order).

Each prompt is generated with mode="ar" and plan "auto", alternating which goes first; every
round's wall, model and planning time is read from the `rounds.Round` the stepper returns (with
`--batch-size` B, all prompts in one decoder B rows at a time, and tokens a round per row), and
auto's rounds are grouped by what the planner did: "bare" (AR without a forecast: resting or
unfunded), "fc-ar" (forecast, then AR), "probe" (a mask group on the root), "marg-ar" (AR
chosen from marginals) and one group per speculative layout kind. For each group: rounds, ms a
round (model, planning, the rest), tokens a round and the AR rounds it lost (+) or won (-)
against AR mode's mean round on the same prompts. Last, both modes' whole-generation wall time.

    python benchmarks/auto_rounds.py --temperature 0 --repeats 4
    python benchmarks/auto_rounds.py --model models/pystdlib-nld-9m --prompts 8
    python benchmarks/auto_rounds.py --prompts 16 --batch-size 8   # B rows at a time, as the batch bench
    python benchmarks/auto_rounds.py --prompts-file benchmarks/tune_prompts.jsonl --prompts 16 --rest-max 128  # tune
    python benchmarks/auto_rounds.py --file /usr/lib/python3.11/argparse.py --tokens 1000 --max-new-tokens 96
    python benchmarks/auto_rounds.py --suite-prompt edit04 --max-new-tokens 96   # a long-suite request
"""

from __future__ import annotations

import argparse
import collections
import os
import time

from selfspec.checkpoint.model import default_model_dir
from selfspec.engine import step as step_mod
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts


def kind(rnd) -> str:
    o = rnd.option
    if rnd.bare:
        return "bare"
    if o.groups and not o.nodes:
        return "probe"
    if not o.speculative:
        return "marg-ar" if any(r.marg is not None for r in rnd.rows) else "fc-ar"
    return o.family


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8, help="the first N of the model's prompts.jsonl")
    ap.add_argument("--rest-max", type=int, default=None,
                    help="the planner's longest rest (engine.planner.REST_MAX) for this run, to tune it")
    ap.add_argument("--prompts-file", default=None,
                    help="another JSONL instead (benchmarks/tune_prompts.jsonl: a set to tune on, not held out)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1, help="prompts decoded together, in order")
    ap.add_argument("--file", default=None, help="one prompt instead: this text file's first --tokens tokens")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--suite-prompt", default=None, help="one prompt instead: the long suite's request with this id")
    ap.add_argument("--drag", action="store_true",
                    help="split bare and fc-ar rounds by how many rounds ago the last speculative one ran "
                         "(+1, +2, +3, +4-10, +11-30, +31-): what a wide round leaves on the AR rounds after it")
    a = ap.parse_args()
    if a.rest_max is not None:
        from selfspec.engine import planner

        planner.REST_MAX = a.rest_max
    model, tok = load(a.model, progress=False)
    if a.suite_prompt is not None:
        from selfspec.tools.bench_prompts import read_suite

        found = [p for p in read_suite("long") if p["id"] == a.suite_prompt]
        if not found:
            raise SystemExit(f"no long-suite prompt {a.suite_prompt!r}; ids: {[p['id'] for p in read_suite('long')]}")
        encoded = [encode_prompt(tok, found[0]["prompt"])]
    elif a.file is not None:  # a long context (as benchmarks/long_context.py): eos off, so every run decodes alike
        with open(a.file) as f:
            encoded = [tok.encode(f.read())[: a.tokens]]
    else:
        prompts = read_prompts(a.prompts_file or os.path.join(a.model or default_model_dir(), "prompts.jsonl"))[: a.prompts]
        encoded = [encode_prompt(tok, p["prompt"]) for p in prompts]
    # one decoder per prompt, or (--batch-size B > 1) one for all of them, B rows at a time
    sets = [[ids] for ids in encoded] if a.batch_size == 1 else [encoded]
    eos = {"eos_token_id": []} if a.file is not None else {}
    rounds = []  # (mode, kind, seconds, model seconds, plan seconds, tokens) of every round
    real_step = step_mod.Stepper.step
    since = {"auto": 99}  # rounds since auto's last speculative round

    def step(self, *args, **kw):
        rnd = real_step(self, *args, **kw)
        mode = "auto" if self.planner is not None else "ar"
        k = kind(rnd) if mode == "auto" else "ar"
        if mode == "auto":
            since["auto"] = 0 if k not in ("bare", "fc-ar") else since["auto"] + 1
            n = since["auto"]
            if a.drag and k in ("bare", "fc-ar"):
                k += f" +{n}" if n <= 3 else " +4-10" if n <= 10 else " +11-30" if n <= 30 else " +31-"
        rounds.append((mode, k, rnd.seconds, rnd.model_seconds,
                       rnd.plan_seconds, sum(len(r.committed) for r in rnd.rows) / len(rnd.rows)))
        return rnd

    step_mod.Stepper.step = step
    prefills = []  # (mode, call, seconds, prompts, query tokens) of every prefill forward call

    def timed(name):
        real = getattr(step_mod.Stepper, name)

        def call(self, seqs, slot, *args, **kw):
            before = sum(self.cache.lengths[slot : slot + len(seqs)]) if name != "prefill" else 0
            t0 = time.perf_counter()
            out = real(self, seqs, slot, *args, **kw)
            tokens = sum(self.cache.lengths[slot : slot + len(seqs)]) - before
            prefills.append(("auto" if self.planner is not None else "ar", name, time.perf_counter() - t0, out[0]
                             if isinstance(out, tuple) else len(seqs), tokens))
            return out
        return call

    for name in ("prefill", "prefill_rest", "prefill_chunk"):
        setattr(step_mod.Stepper, name, timed(name))
    wall = collections.Counter()
    for rep in range(a.repeats):
        for ids in sets:
            for mode in ("ar", "auto") if rep % 2 == 0 else ("auto", "ar"):
                cfg = DecodeConfig(mode=mode, max_new_tokens=a.max_new_tokens, temperature=a.temperature)
                t0 = time.perf_counter()
                for _ in Decoder(model, ids, cfg, batch_size=a.batch_size, seeds=list(range(len(ids))), **eos):
                    pass
                wall[mode] += time.perf_counter() - t0
    ar = [r for r in rounds if r[0] == "ar"]
    ar_round = sum(r[2] for r in ar) / len(ar)
    print(f"AR: {len(ar)} rounds, {ar_round * 1e3:.3f} ms a round (model {sum(r[3] for r in ar) / len(ar) * 1e3:.3f})")
    print("| auto's rounds | n | ms a round | model | planning us | rest us | tokens a round | AR rounds lost |")
    print("|---|---|---|---|---|---|---|---|")
    groups = collections.defaultdict(list)
    for r in rounds:
        if r[0] == "auto":
            groups[r[1]].append(r)
    for k, rs in sorted(groups.items()):
        n, s, m, pl, tokens = len(rs), *(sum(r[i] for r in rs) for i in (2, 3, 4, 5))
        print(f"| {k} | {n} | {s / n * 1e3:.3f} | {m / n * 1e3:.3f} | {pl / n * 1e6:.0f} "
              f"| {(s - m - pl) / n * 1e6:.0f} | {tokens / n:.2f} | {(s - tokens * ar_round) / ar_round:+.1f} |")
    print("| prefill calls | mode | n | prompts done | tokens | s in all | ms a prompt |")
    print("|---|---|---|---|---|---|---|")
    for key in sorted({(p[0], p[1]) for p in prefills}):
        ps = [p for p in prefills if (p[0], p[1]) == key]
        done, sec = sum(p[3] for p in ps), sum(p[2] for p in ps)
        print(f"| {key[1]} | {key[0]} | {len(ps)} | {done} | {sum(p[4] for p in ps)} | {sec:.3f} "
              f"| {sec / max(done, 1) * 1e3:.1f} |")
    print(f"whole generations: AR {wall['ar']:.3f} s, auto {wall['auto']:.3f} s: "
          f"auto / AR {wall['ar'] / wall['auto']:.3f}x")


if __name__ == "__main__":
    main()
