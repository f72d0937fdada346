"""A one-token forward's time right after a wider one: how long a wide forward slows the next ones.

    python benchmarks/forward_after.py                               # after 128, 32, 16 and 4 tokens
    python benchmarks/forward_after.py --before 128 --pause 0 0.1 --after 12

The default model, one row over `--cached` tokens, through the runtime's `BatchForward` (a causal
block of w new tokens plus the output head on min(w, 48) rows, as `cost.measure` times a point).
Each trial runs 15 one-token forwards (the steady state), one forward of `--before` tokens, an
optional sleep (`--pause` seconds), then `--after` one-token forwards, each timed. Trials
alternate over the configurations `--repeats` times; prints the median of each position in ms,
with the steady one-token time. The cost model times every point after calls of its own shape
(`engine/cost.py`, `best_of_sweeps`) because of what this shows on some machines.
"""

import argparse
import statistics
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", nargs="+", type=int, default=[128, 32, 16, 4])
    ap.add_argument("--pause", nargs="+", type=float, default=[0.0])
    ap.add_argument("--after", type=int, default=10)
    ap.add_argument("--cached", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    import torch

    import selfspec
    from selfspec.engine.batch_forward import BatchForward

    model = selfspec.load(progress=False)[0]
    bf = BatchForward.of(model)
    widest = max(a.before)
    cache = bf.new_cache(1, a.cached + widest + 1)
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    torch.set_grad_enabled(False)
    bf(torch.randint(0, V, (1, a.cached), generator=gen), torch.arange(a.cached)[None], cache, slice(0, 1), causal=True)
    blocks = {w: torch.full((w, w), float("-inf")).triu_(1).expand(1, w, w) for w in set(a.before) | {1}}

    def forward(w: int) -> float:
        cache.set_length(0, a.cached)
        t0 = time.perf_counter()
        h = bf(torch.randint(0, V, (1, w), generator=gen), torch.arange(w).expand(1, w), cache, slice(0, 1),
               block=blocks[w])
        bf.logits(h[:, : min(w, 48)].reshape(-1, h.shape[-1]))
        return time.perf_counter() - t0

    configs = [(w, p) for w in a.before for p in a.pause]
    times: dict = {c: [] for c in configs}
    steady = []
    for r in range(a.repeats + 1):
        for c in configs if r % 2 == 0 else configs[::-1]:
            warm = [forward(1) for _ in range(15)]
            forward(c[0])
            if c[1]:
                time.sleep(c[1])
            after = [forward(1) for _ in range(a.after)]
            if r:  # the first pass warms up
                times[c].append(after)
                steady += warm[-5:]
    print(f"one-token forward after {a.cached} cached tokens, steady: {statistics.median(steady) * 1e3:.2f} ms")
    print("before  pause   then one-token forwards, ms (median of each position)")
    for (w, p), runs in times.items():
        cols = [statistics.median(col) * 1e3 for col in zip(*runs)]
        print(f"{w:6d} {p:6.2f}   " + " ".join(f"{x:5.2f}" for x in cols))


if __name__ == "__main__":
    sys.exit(main())
