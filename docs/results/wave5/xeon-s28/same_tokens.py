"""The sampled and greedy tokens of every mode, temperature and batch size on the first 8 tune prompts
(48 new tokens, seeds 0..7), as JSON: run it from two checkouts and compare the files. Run from a
checkout's root:

    PYTHONPATH=. python docs/results/wave5/xeon-s28/same_tokens.py OUT.json
"""
import sys, json
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p["prompt"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")[:8]]
out = {}
for mode in ("ar", "auto", "lookup"):
    for T in (1.0, 0.7):
        for B in (1, 8):
            cfg = DecodeConfig(mode=mode, max_new_tokens=48, temperature=T)
            d = Decoder(model, enc, cfg, batch_size=B, seeds=list(range(len(enc))))
            for _ in d: pass
            out[f"{mode}-{T}-{B}"] = d.outputs
json.dump(out, open(sys.argv[1], "w"))
