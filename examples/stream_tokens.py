"""Stream a continuation token by token from Python (the shipped model, or --model DIR).

    python examples/stream_tokens.py --prompt "def quicksort(xs):\n"
"""

import argparse

import selfspec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt", default="def quicksort(xs):\n")
    ap.add_argument("--mode", default="presto")
    a = ap.parse_args()
    model, tok = selfspec.load(a.model)
    gen = selfspec.stream(model, tok, a.prompt.encode().decode("unicode_escape"), max_new_tokens=80,
                          mode=a.mode, schedule="two-pass", budget=32, stop=["\n\n\n"])
    for delta in gen:  # text deltas arrive round by round; multi-byte characters are never split
        print(delta, end="", flush=True)
    s = gen.stats
    print(f"\n-- {s.new_tokens} tokens in {s.rounds} rounds: tau {s.tau:.2f}, oracle tau {s.oracle_tau:.2f}, "
          f"{s.new_tokens / s.seconds:.0f} tok/s, finish: {gen.finish_reason}")


if __name__ == "__main__":
    main()
