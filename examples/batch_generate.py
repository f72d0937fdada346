"""Many prompts at once: stream a batch as its rows commit, then read each row's result.

    python examples/batch_generate.py [--model DIR] [--batch-size 4] [--mode ar] [--trace-dir DIR]

Rows run together (one batched forward per round), finish on their own and hand their cache row
to the next waiting prompt; every row equals what it would be alone. Plan "auto" (the default)
chooses one layout per round for the whole batch: see each row's `plan_hist`. `--trace-dir`
records every row's rounds and writes one HTML trace per row (`row<i>.html`).
"""

import argparse
import os
import time

import selfspec

PROMPTS = [
    "def is_even(n):\n",
    [{"role": "user", "content": "Name three sorting algorithms."}],
    "import json\n\n\ndef save(obj, path):\n",
    [{"role": "user", "content": "What is a Python generator?"}],
    "class Counter:\n    def __init__(self):\n",
    "def read_lines(path):\n",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--mode", default=None, help="ar / lookup / linear / presto (default: plan auto)")
    ap.add_argument("--trace-dir", default=None, help="write each row's trace as <dir>/row<i>.html")
    a = ap.parse_args()
    model, tok = selfspec.load(a.model)
    layout = {} if a.mode is None else {"mode": a.mode}
    t0 = time.perf_counter()
    chat = getattr(tok, "chat_template", None) is not None
    prompts = [p for p in PROMPTS if chat or isinstance(p, str)]  # a base model without a template: text only
    gen = selfspec.stream(model, tok, prompts, batch_size=a.batch_size, max_new_tokens=a.max_new_tokens,
                          trace=a.trace_dir is not None, **layout)
    for row, delta in gen:  # deltas of all rows, interleaved as rows commit
        print(f"[{row}] {delta!r}")
    dt = time.perf_counter() - t0
    for i, res in enumerate(gen.results):
        print(f"-- row {i}: {res.finish_reason}, {len(res.token_ids)} tokens, tau {res.stats.tau:.2f}, "
              f"layouts {dict(res.stats.plan_hist)}\n{res.text}")
    print(f"-- {sum(len(r.token_ids) for r in gen.results) / dt:.1f} tokens/s for the batch")
    if a.trace_dir is not None:
        os.makedirs(a.trace_dir, exist_ok=True)
        for i, res in enumerate(gen.results):
            res.trace.save(os.path.join(a.trace_dir, f"row{i}.html"))
        print(f"-- {len(gen.results)} traces in {a.trace_dir}")


if __name__ == "__main__":
    main()
