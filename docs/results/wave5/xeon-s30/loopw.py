"""A loop of width-W forwards (+ head) after C tokens of the first ~3k long-suite prompt; writes its pid to
/tmp/s30/ready once warm (for perf record -p). python docs/results/wave5/xeon-s30/loopw.py C N [W]"""
import sys, time, torch, selfspec, os
from selfspec.engine.batch_forward import BatchForward
from selfspec.tools.bench_prompts import read_suite
c = int(sys.argv[1]); n = int(sys.argv[2]); w = int(sys.argv[3]) if len(sys.argv) > 3 else 1
model, tok = selfspec.load(progress=False)
bf = BatchForward.of(model)
text = [p for p in read_suite("long") if p["length"] == "3k"][0]["prompt"]
ids = torch.tensor(tok.encode(text if isinstance(text, str) else str(text))[:c])
cache = bf.new_cache(1, c + 32)
bf(ids[None], torch.arange(c)[None], cache, slice(0, 1), causal=True)
cache.set_length(0, c)
toks, pos = (torch.arange(w) + 7)[None], torch.arange(w)[None]
block = torch.full((w, w), float("-inf")).triu(1)[None]
for i in range(20): bf.logits(bf(toks, pos, cache, slice(0, 1), block=block)[0])
open("/tmp/s30/ready", "w").write(str(os.getpid()))
ts = []
for i in range(n):
    t0 = time.perf_counter(); bf.logits(bf(toks, pos, cache, slice(0, 1), block=block)[0]); ts.append(time.perf_counter() - t0)
ts.sort(); print(f"cached {len(ids)} width {w}: best {ts[0]*1e3:.2f} median {ts[len(ts)//2]*1e3:.2f} ms")
