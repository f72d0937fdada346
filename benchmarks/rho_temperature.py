"""tau of PRESTO with the n-gram rho vs learned predictors, at a given temperature, over seeds.

    OMP_NUM_THREADS=1 python benchmarks/rho_temperature.py --temperature 1 --seeds 0 1 2 3 \
        --limit 16 --predictor t1=runs/pred_t1 --predictor shipped=models/pystdlib-nld-9m --out runs/rho_t1.json

Every row runs the same prompts (the model's held-out prompts.jsonl, first --limit) with the same
seeds; at T > 0 each (prompt, seed) is one sampled generation, and tau is pooled over all of them
(committed tokens / verification rounds), as in `selfspec bench`. Prints one JSON line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from selfspec.tools.bench import aggregate, read_prompts
from selfspec.engine.options import DecodeConfig
from selfspec.checkpoint.model import default_model_dir, load
from selfspec.training.predictor import Predictor
from selfspec.engine.decoder import Decoder
from selfspec.streaming import encode_prompt


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--temperature", type=float, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--schedule", default="one-pass")
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--ngram-lams", type=float, nargs="*", default=[0.0, 0.2, 1.0])
    ap.add_argument("--learned-lams", type=float, nargs="*", default=[0.2, 1.0, 4.0])
    ap.add_argument("--predictor", action="append", default=[], help="NAME=DIR holding presto_predictor.*")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model, tok = load()
    prompts = read_prompts(os.path.join(default_model_dir(), "prompts.jsonl"))[: a.limit]
    encoded = [encode_prompt(tok, p["prompt"]) for p in prompts]
    rows = [("none" if lam == 0 else "ngram", None, lam) for lam in a.ngram_lams]
    preds = {}
    for spec in a.predictor:
        name, path = spec.split("=", 1)
        preds[name] = Predictor.load(path)
        if preds[name] is None:
            raise SystemExit(f"error: no predictor in {path}")
        rows += [("learned", name, lam) for lam in a.learned_lams]
    results = []
    for rho, name, lam in rows:
        if name is not None:
            model.presto_predictor = preds[name]
        cfg = DecodeConfig(mode="presto", schedule=a.schedule, budget=a.budget, rho=rho, lam=lam,
                           temperature=a.temperature, max_new_tokens=a.max_new_tokens)
        per_seed = []
        records = []
        for seed in a.seeds:
            recs = []
            for ids in encoded:
                dec = Decoder(model, [ids], cfg, generators=[torch.Generator().manual_seed(seed)])
                for _ in dec:
                    pass
                st = dec.stats[0]
                recs.append({k: getattr(st, k) for k in ("new_tokens", "rounds", "forwards", "round_tokens", "seconds",
                                                          "forward_seconds", "tree_seconds", "accept_lengths",
                                                          "oracle_lengths")})
            per_seed.append(round(aggregate(recs)["tau"], 4))
            records += recs
        agg = aggregate(records)
        row = {"rho": rho, "predictor": name, "lam": lam, "temperature": a.temperature, "tau": round(agg["tau"], 4),
               "tau_per_seed": per_seed, "oracle_tau": round(agg["oracle_tau"], 4), "generations": len(records)}
        print(json.dumps(row), flush=True)
        results.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
