"""Old (no prefix copy on the chunk path) vs new, AR and auto, batches, one process, mirrored."""
import os, sys, time
from collections import Counter
import selfspec
from selfspec.checkpoint.model import default_model_dir
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.engine import step as stepmod
from selfspec.streaming import encode_prompt
from selfspec.tools.bench import read_prompts
Bs = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else [4]
T = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
REP = int(sys.argv[3]) if len(sys.argv) > 3 else 3
model, tok = selfspec.load(progress=False)
prompts = [encode_prompt(tok, p["prompt"]) for p in read_prompts(os.path.join(default_model_dir(), "prompts.jsonl"))]
new_share = stepmod.Stepper.share_prefixes
for _ in Decoder(model, prompts[:2], DecodeConfig(mode="ar", max_new_tokens=4)): pass
for B in Bs:
    secs, toks, outs = Counter(), Counter(), {}
    runs = [("ar", "old"), ("ar", "new"), ("auto", "old"), ("auto", "new")]
    for rep in range(REP):
        for mode, way in (runs if rep % 2 == 0 else runs[::-1]):
            stepmod.Stepper.share_prefixes = new_share if way == "new" else (lambda self, *a: None)
            dec = Decoder(model, prompts, DecodeConfig(mode=mode, max_new_tokens=64, temperature=T), batch_size=B,
                          seeds=list(range(len(prompts))))
            t0 = time.perf_counter()
            for _ in dec: pass
            secs[(mode, way)] += time.perf_counter() - t0
            toks[(mode, way)] += sum(len(o) for o in dec.outputs)
            outs.setdefault((mode, way), dec.outputs)
    rate = {k: toks[k] / secs[k] for k in secs}
    print(f"B={B} T={T:g}: " + ", ".join(f"{m}/{w} {rate[(m, w)]:.1f} tok/s" for m, w in runs)
          + f"; new/old AR {rate[('ar','new')]/rate[('ar','old')]:.3f} auto {rate[('auto','new')]/rate[('auto','old')]:.3f}"
          + f"; auto/AR old {rate[('auto','old')]/rate[('ar','old')]:.3f} new {rate[('auto','new')]/rate[('ar','new')]:.3f}"
          + ("" if T else f"; outputs equal: {all(o == outs[('ar','old')] for o in outs.values())}"), flush=True)
