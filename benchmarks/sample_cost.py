"""What a sampled token costs beyond a greedy one, by part, on a real logits row of the default model.

    python benchmarks/sample_cost.py

One process, the mean of 400 calls each: the whole draw at T = 1 for a fresh output position
(`drafting.sampling.select` with the position's keyed noise and the C candidates), as the runtime
makes it (the position's largest uniform, in the candidates' kernel, and the candidates' uniforms
made where read) and with the position's whole row of uniforms made first (as before the
twenty-second session), its noise rows (the position's seed; with its whole row), the ban's copy,
the Gumbel-max over the candidates, the candidates alone, and the greedy argmax for comparison.
"""
import time

import torch

from selfspec.drafting.sampling import PositionNoise, gumbel_argmax, process_logits, select
from selfspec.engine.batch_forward import BatchForward
from selfspec.kernels.layer import gumbel_candidates, uniforms
from selfspec.loading import load


def timed(name: str, f, n: int = 400) -> None:
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    print(f"{name}: {(time.perf_counter() - t0) / n * 1e6:.1f} us", flush=True)


def main() -> None:
    torch.set_num_threads(2)
    model, tok = load(progress=False)
    bf = BatchForward.of(model)
    ids = tok("def parse_args(argv):\n    parser = argparse.ArgumentParser(")["input_ids"]
    cache = bf.new_cache(1, len(ids) + 4)
    logits = bf.logits(bf(torch.tensor([ids]), torch.arange(len(ids))[None], cache, slice(0, 1), causal=True)[0, -1:])
    V, banned = logits.shape[-1], model.config.vocab_size - 1
    pos = [0]

    def draw(seeded: bool):
        pos[0] += 1
        noise = PositionNoise(5, V, fast=uniforms).rows([pos[0]])
        if not seeded:
            noise.u  # noqa: B018 (the position's whole row, made first)
        return select(logits, temperature=1.0, banned=banned, candidates=gumbel_candidates, noise=noise)

    timed("select at T = 1, a fresh position", lambda: draw(True))
    timed("  with the position's whole row of uniforms", lambda: draw(False))
    timed("  its noise rows (the position's seed, no row)", lambda: PositionNoise(5, V, fast=uniforms).rows([7]))
    timed("  its noise rows and its whole row", lambda: PositionNoise(5, V, fast=uniforms).rows([7]).u)
    timed("  the ban's copy (process_logits)", lambda: process_logits(logits, temperature=1.0, banned=banned))
    x = process_logits(logits, temperature=1.0, banned=banned)
    rows = PositionNoise(5, V, fast=uniforms).rows([7])
    timed("  the Gumbel-max over the candidates", lambda: gumbel_argmax(x, rows, gumbel_candidates))
    timed("    the candidates alone", lambda: gumbel_candidates(x, rows.u, rows.rows))
    timed("greedy: argmax of the float32 row", lambda: x.argmax(-1))


if __name__ == "__main__":
    main()
