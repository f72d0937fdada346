"""A C-token prompt (the first ~3k long-suite prompt) prefilled N times, AR. python .../prefill.py C N"""
import sys, time, torch, selfspec
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.tools.bench_prompts import read_suite
c = int(sys.argv[1]); n = int(sys.argv[2])
model, tok = selfspec.load(progress=False)
text = [p for p in read_suite("long") if p["length"] == "3k"][0]["prompt"]
ids = tok.encode(text if isinstance(text, str) else str(text))[:c]
for i in range(n):
    t0 = time.perf_counter()
    for _ in Decoder(model, [ids], DecodeConfig(mode="ar", max_new_tokens=1)): pass
    print(f"prefill {len(ids)}: {time.perf_counter() - t0:.2f} s", flush=True)
