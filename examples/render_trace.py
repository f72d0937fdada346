"""Render one PRESTO round from a real trace of the shipped model (docs/img/trace_round.svg).

    python examples/render_trace.py [--out docs/img/trace_round.svg] [--html trace.html]

Greedy, PRESTO one-pass, budget 32, n-gram rho with lambda 0.2 (fixed here: the default plan
"auto" chooses layouts per round, and on a CPU that is mostly AR and lookup), on the first held-out prompt of
the shipped model; the drawn round is the first one with the longest accepted path. The SVG is
`selfspec.trace_html.round_svg`, the same drawing as in the HTML page of `python -m selfspec trace`.
"""

import argparse
import json
import os

import selfspec
from selfspec.trace_html import round_svg


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/img/trace_round.svg")
    ap.add_argument("--html", default=None, help="also write the whole trace page here")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    a = ap.parse_args()
    model, tok = selfspec.load()
    with open(os.path.join(selfspec.default_model_dir(), "prompts.jsonl"), encoding="utf-8") as f:
        prompt = json.loads(f.readline())["prompt"]
    gen = selfspec.generate(model, tok, prompt, max_new_tokens=a.max_new_tokens, trace=True, mode="presto",
                            schedule="one-pass", budget=32, rho="ngram", lam=0.2, lookup=False)
    rounds = gen.trace.rounds
    best = max(range(len(rounds)), key=lambda i: (len(rounds[i].path), -i))
    with open(a.out, "w", encoding="utf-8") as f:
        f.write(round_svg(gen.trace, best))
    if a.html:
        gen.trace.save(a.html)
    r = rounds[best]
    print(f"{a.out}: round {best} of {len(rounds)}, {len(r.tokens)} nodes, accepted {len(r.path) - 1} + bonus")


if __name__ == "__main__":
    main()
