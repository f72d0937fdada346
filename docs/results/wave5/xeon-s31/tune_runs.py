"""The A/B scripts' shared loop (prior_ab.py, profile_ab.py): auto / AR decode time on tune prompts only, the
long suite's tune half (eos off, 96 tokens, T = 0) or benchmarks/tune_prompts.jsonl (64 tokens, T = 0 and 1),
AR and auto alternating per prompt, decode timed after the prefill's token as the bench does."""
import time

import torch

from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts, read_suite


def run(model, tok, suite, label, *, reps=1, profile=None, hist=False, length=None):
    if suite == "long":  # `length`: "1k" or "3k" only
        prompts, temps, new, no_eos = [p for p in read_suite("long") if p["split"] == "tune"
                                       and length in (None, p["length"])], [0.0], 96, {"eos_token_id": []}
    else:
        prompts, temps, new, no_eos = read_prompts("benchmarks/tune_prompts.jsonl"), [0.0, 1.0], 64, {}

    def decode(ids, mode, t, seed):
        gen = torch.Generator().manual_seed(seed)
        dec = Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=new, temperature=t), generators=[gen],
                      profile=profile if mode == "auto" else None, **no_eos)
        first = None
        for _ in dec:
            first = first or time.perf_counter()
        return list(dec.outputs[0]), time.perf_counter() - first, dec.stats[0]

    for t in temps:
        tot, by, plans = {"ar": 0.0, "auto": 0.0}, {}, {}
        for rep in range(reps):
            for i, p in enumerate(prompts):
                ids = encode_prompt(tok, p["prompt"])
                outs = {}
                for mode in (("ar", "auto") if (i + rep) % 2 == 0 else ("auto", "ar")):
                    outs[mode], dt, st = decode(ids, mode, t, i)
                    tot[mode] += dt
                    key = p.get("length", p["id"].rstrip("0123456789"))
                    by.setdefault(key, {"ar": 0.0, "auto": 0.0})[mode] += dt
                    if mode == "auto":
                        for k, v in st.plan_hist.items():
                            plans[k] = plans.get(k, 0) + v
                if t == 0 and outs["ar"] != outs["auto"]:
                    raise SystemExit(f"{p['id']}: auto's greedy output differs from AR's")
        line = f"{label} {suite} T={t}: auto/AR {tot['ar'] / tot['auto']:.3f} " + " ".join(
            f"{k} {v['ar'] / v['auto']:.3f}" for k, v in sorted(by.items()))
        if hist:
            line += f" | speculative rounds {sum(v for k, v in plans.items() if k != 'ar')} of {sum(plans.values())}"
        print(line, flush=True)
