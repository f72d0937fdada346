"""Compare AR, the automatic plan, prompt lookup, linear, PRESTO and hybrid trees on a prompt file
with the bench machinery, in Python.

    python examples/compare_modes.py [--prompts models/pystdlib-nld-9m/prompts.jsonl] [--limit 8]
(`python -m selfspec bench` is the full command-line version, with plots and results.json.)
"""

import argparse
import os

import selfspec
from selfspec.tools.bench import grid, markdown_table, read_prompts, run_bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default=os.path.join(selfspec.default_model_dir(), "prompts.jsonl"))
    ap.add_argument("--limit", type=int, default=8)
    a = ap.parse_args()
    model, tok = selfspec.load(a.model)
    prompts = read_prompts(a.prompts)[: a.limit]
    configs = grid(["ar", "auto", "lookup", "linear", "presto", "hybrid"], ["two-pass", "one-pass"], [8, 32],
                   {"max_new_tokens": 64})
    rows = run_bench(model, tok, prompts, configs, peers=("hf", "hf-lookup"))
    print(markdown_table(rows))


if __name__ == "__main__":
    main()
