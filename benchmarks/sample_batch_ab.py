"""Sampled rows' targets one row at a time against the runtime's way (`engine.targets`: rows alike
in one draw, their candidates found on the threads), whole
batched AR generations alternating in one process (A B B A ...).

    python benchmarks/sample_batch_ab.py --batch-size 8 --repeats 6
    python benchmarks/sample_batch_ab.py --batch-size 1 --temperature 0.7
    python benchmarks/sample_batch_ab.py --batch-size 8 --candidates-max 16 4   # the runtime's way, two limits

The default model's first 16 prompts, 64 new tokens, seeds 0..15 (reproducible sampling): prints
both ways' seconds, their ratio and whether they gave the same tokens (they must). With
`--candidates-max A B` the runtime's way runs twice instead, with `kernels.layer.CANDIDATES_MAX`
A and B (a row with more than 1/CANDIDATES_MAX of the tokens as candidates takes the full draw).
"""

import argparse
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--candidates-max", type=int, nargs=2, default=None)
    a = ap.parse_args()
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine import step as step_mod
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.kernels import layer
    from selfspec.loading import load
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_prompts

    model, tok = load(progress=False)
    prompts = read_prompts(os.path.join(default_model_dir(), "prompts.jsonl"))[: a.prompts]
    enc = [encode_prompt(tok, p["prompt"]) for p in prompts]
    real, default_max = step_mod.Stepper.targets_of, layer.CANDIDATES_MAX

    def per_row(self, parts):
        return [real(self, [p])[0] for p in parts]

    ways = {"one row at a time": (per_row, layer.CANDIDATES_MAX), "rows alike together": (real, layer.CANDIDATES_MAX)}
    if a.candidates_max:
        ways = {f"CANDIDATES_MAX {c}": (real, c) for c in a.candidates_max}
    seconds, outs = dict.fromkeys(ways, 0.0), {}
    names = list(ways)
    try:
        for rep in range(a.repeats):
            for name in names if rep % 2 == 0 else names[::-1]:
                step_mod.Stepper.targets_of, layer.CANDIDATES_MAX = ways[name]
                cfg = DecodeConfig(mode="ar", max_new_tokens=64, temperature=a.temperature)
                t0 = time.perf_counter()
                d = Decoder(model, enc, cfg, batch_size=a.batch_size, seeds=list(range(len(enc))))
                for _ in d:
                    pass
                seconds[name] += time.perf_counter() - t0
                outs.setdefault(name, d.outputs)
    finally:
        step_mod.Stepper.targets_of = real
        layer.CANDIDATES_MAX = default_max
    old, new = (seconds[n] for n in names)
    print(f"AR, B = {a.batch_size}, T = {a.temperature:g}: {names[0]} {old:.3f} s, {names[1]} {new:.3f} s "
          f"({old / new:.3f}x); same tokens: {outs[names[0]] == outs[names[1]]}")


if __name__ == "__main__":
    main()
