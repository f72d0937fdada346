"""Greedy acceptance of SmolLM2-135M-Instruct's draft LoRA, measured with the runtime.

    python benchmarks/draft_lora_acceptance.py [--adapter DIR] [--n 8] [--out docs/results/wave3/draft_lora_acceptance.json]

The first `--n` held-out prompts of `models/smollm2-135m-instruct/prompts.jsonl` (never trained
on), 64 new greedy tokens each: `mode="ar"`, then `mode="linear"` two-pass (block_length 8) and
one-pass (group 8), each with and without the draft LoRA. Reports tau (tokens committed per
verification round), the accept lengths, and whether every output equals AR token for token.
`--adapter DIR`: a folder holding `linear_spec_lora/` (default: the registry's model folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapter", default=None)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    import selfspec
    from selfspec.checkpoint.lora import load_draft_lora
    from selfspec.engine.stats import Stats

    model, tok = selfspec.load("smollm2-135m-instruct", draft_lora=a.adapter is None)
    if a.adapter:
        model.draft_lora = load_draft_lora(model, a.adapter)
    if model.draft_lora is None:
        raise SystemExit("no linear_spec_lora adapter found")
    with open(os.path.join(HERE, "models", "smollm2-135m-instruct", "prompts.jsonl")) as f:
        rows = [json.loads(line) for line in f][: a.n]
    settings = {f"{s}{'' if lora else ' no-lora'}": dict(mode="linear", schedule=s, block_length=8, draft_lora=lora)
                for s in ("two-pass", "one-pass") for lora in (True, False)}
    runs = {k: [] for k in settings}
    equal = {k: True for k in settings}
    for row in rows:
        prompt = row.get("messages") or row["prompt"]
        ar = selfspec.generate(model, tok, prompt, max_new_tokens=a.max_new_tokens, mode="ar").token_ids
        for k, kw in settings.items():
            g = selfspec.generate(model, tok, prompt, max_new_tokens=a.max_new_tokens, **kw)
            runs[k].append(g.stats)
            equal[k] &= list(g.token_ids) == list(ar)
            print(f"{row['id']:8s} {k:18s} tau {g.stats.tau:.3f} accept {g.stats.accept_lengths} equal_ar "
                  f"{list(g.token_ids) == list(ar)}", flush=True)
    out = {"prompts": [r["id"] for r in rows], "max_new_tokens": a.max_new_tokens, "block_length": 8}
    for k in settings:
        tot = Stats.total(runs[k])
        out[k] = {"tau": round(tot.tau, 4), "rounds": tot.rounds, "accept_lengths": tot.accept_lengths,
                  "equal_ar": equal[k], "per_prompt_tau": [round(s.tau, 3) for s in runs[k]]}
        print(f"{k:18s} tau {tot.tau:.3f} over {tot.rounds} rounds, equal to AR: {equal[k]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
