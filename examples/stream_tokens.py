"""Stream a continuation token by token from Python (the shipped model, or --model DIR).

    python examples/stream_tokens.py --prompt "def quicksort(xs):\n"
"""

import argparse

import selfspec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="def quicksort(xs):\n")
    ap.add_argument("--mode", default=None, help="ar / linear / presto / lookup (default: plan auto)")
    a = ap.parse_args()
    model, tok = selfspec.load(a.model)
    layout = {} if a.mode is None else dict(mode=a.mode, schedule="two-pass", budget=32)
    gen = selfspec.stream(model, tok, a.prompt.encode().decode("unicode_escape"), max_new_tokens=80,
                          stop=["\n\n\n"], **layout)
    for delta in gen:  # text deltas arrive round by round; multi-byte characters are never split
        print(delta, end="", flush=True)
    s = gen.stats
    oracle = "-" if s.oracle_tau is None else f"{s.oracle_tau:.2f}"
    print(f"\n-- {s.new_tokens} tokens in {s.rounds} rounds: tau {s.tau:.2f}, oracle tau {oracle}, "
          f"{s.new_tokens / s.seconds:.0f} tok/s, finish: {gen.finish_reason}, layouts {dict(s.plan_hist)}")


if __name__ == "__main__":
    main()
