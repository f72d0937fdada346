"""Minor page faults and system time of a C-token prefill (three in a row). python .../pf.py C"""
import sys, time, resource, selfspec
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.tools.bench_prompts import read_suite
model, tok = selfspec.load(progress=False)
text = [p for p in read_suite("long") if p["length"] == "3k"][0]["prompt"]
ids = tok.encode(text if isinstance(text, str) else str(text))[:int(sys.argv[1])]
def ru(): r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_minflt, r.ru_stime, r.ru_utime
for i in range(3):
    f0, s0, u0 = ru(); t0 = time.perf_counter()
    for _ in Decoder(model, [ids], DecodeConfig(mode="ar", max_new_tokens=1)): pass
    f1, s1, u1 = ru()
    print(f"prefill {len(ids)}: {time.perf_counter()-t0:.2f} s wall, minor faults {f1-f0}, sys {s1-s0:.2f} s, user {u1-u0:.2f} s", flush=True)
