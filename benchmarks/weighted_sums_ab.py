"""The exact attention's weighted sums in int32 lanes (AVX-512 VNNI, `kernels/attn16_words.h`) against
the float64 tiles they replace, on a long prompt of the shipped long suite: the same model and
process, the path switched off and on (`attn16_set_int_pv`) in mirrored pairs (off on, on off, ...).

    python benchmarks/weighted_sums_ab.py --prompt edit03 --tokens 3000 --pairs 4

Times the first token (prefill) and the decode after it (ms per token, `--new` greedy tokens, eos
off) of each run; the tokens must be the same both ways (the two paths give the same bits). Prints
one JSON record with the command. On a CPU without AVX-512 VNNI both runs take the float64 tiles.
"""

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default="edit03", help="an id of the long suite (selfspec/data/long)")
    ap.add_argument("--tokens", type=int, default=3000, help="the prompt cut to this many tokens")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--mode", default="ar", choices=["ar", "auto", "lookup"])
    ap.add_argument("--pairs", type=int, default=4)
    a = ap.parse_args()
    import selfspec
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.kernels import attn16
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_suite

    switch = attn16._fn("attn16_set_int_pv")
    if switch is None:
        raise SystemExit("error: no attn16 kernel here (a C compiler is needed)")
    prompts = {p["id"]: p for p in read_suite("long")}
    if a.prompt not in prompts:
        raise SystemExit(f"error: no prompt {a.prompt!r} in the long suite ({', '.join(sorted(prompts))})")
    model, tok = selfspec.load(progress=False)
    ids = encode_prompt(tok, prompts[a.prompt]["prompt"])[: a.tokens]
    cfg = DecodeConfig(mode=a.mode, max_new_tokens=a.new, temperature=0.0)
    for _ in Decoder(model, [ids[:256]], DecodeConfig(mode=a.mode, max_new_tokens=8), eos_token_id=[]):
        pass  # warm-up: first calls, the cost model
    runs, outs = {"float64": [], "int32": []}, {}
    for rep in range(a.pairs):
        for on in ((0, 1) if rep % 2 == 0 else (1, 0)):
            name = "int32" if on else "float64"
            before = switch(on)
            try:
                dec = Decoder(model, [ids], cfg, eos_token_id=[])
                t0 = time.perf_counter()
                it = iter(dec)
                next(it)
                t1 = time.perf_counter()
                for _ in it:
                    pass
                t2 = time.perf_counter()
            finally:
                switch(before)
            out = dec.outputs[0]
            outs.setdefault(name, out)
            runs[name].append({"first_token_s": round(t1 - t0, 3),
                               "decode_ms_per_token": round((t2 - t1) / max(1, len(out) - 1) * 1e3, 3)})
    print(json.dumps({"command": "python " + " ".join(sys.argv), "prompt": a.prompt, "tokens": len(ids),
                      "mode": a.mode, "new": a.new, "runs": runs, "same_tokens": outs["float64"] == outs["int32"]}))


if __name__ == "__main__":
    main()
