"""auto with the most funds a generation inherits at several values, each with its own stored planners, against AR, in one process
(mirrored order); the tune prompts, 128 tokens. python eps_ab.py T REPEATS EPS..."""
import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))  # the checkout
import sys, time, collections
from selfspec.engine import ledger, planner
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
T, reps, epss = float(sys.argv[1]), int(sys.argv[2]), [float(x) for x in sys.argv[3:]]
# here a variant is the most funds a generation inherits (CAP: today's rule)
real_begin = planner.Planner.begin
cap = {"v": None}
def begin(self):
    real_begin(self)
    if cap["v"] is not None:
        self.ledger.funds = min(self.ledger.funds, cap["v"])
planner.Planner.begin = begin
model, tok = load(None, progress=False)
ps = read_prompts(os.path.join(ROOT, "benchmarks/tune_prompts.jsonl"))
stores = {e: {} for e in epss}
def run(variant):
    by = collections.Counter(); out = []
    if variant == "ar":
        mode = "ar"
    else:
        mode = "auto"; cap["v"] = variant; model.__dict__["_selfspec_planners"] = stores[variant]
    for i, p in enumerate(ps):
        ids = encode_prompt(tok, p.get("prompt") or p["messages"])
        t0 = time.perf_counter(); toks = []
        for _, chunk in Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=128, temperature=T), seeds=[i]):
            toks += list(chunk)
        by["code" if "code" in p["id"] else "chat"] += time.perf_counter() - t0
        out.append(toks)
    return by, out
variants = ["ar"] + epss
run("ar"); [run(e) for e in epss]  # warm-up: each variant's planner learns on the same prompts once
tot = {v: collections.Counter() for v in variants}
ref = None
for r in range(reps):
    order = variants if r % 2 == 0 else variants[::-1]
    for v in order:
        by, out = run(v)
        tot[v].update(by)
        if v == "ar" and ref is None: ref = out
        if T == 0 and out != ref: print("DIFFERENT TOKENS", v)
for v in variants:
    t = tot[v]
    print(f"{str(v):6s} code {t['code']:.3f} s chat {t['chat']:.3f} s | auto/AR code {tot['ar']['code']/t['code']:.3f}x "
          f"chat {tot['ar']['chat']/t['chat']:.3f}x all {(tot['ar']['code']+tot['ar']['chat'])/(t['code']+t['chat']):.3f}x")
