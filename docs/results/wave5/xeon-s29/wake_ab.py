"""auto with the wake charged (the working tree) against HEAD's round-cost rules (no wake), each with its own
stored planners, against AR, in one process (mirrored order): the tune prompts, 128 tokens, T.
python wake_ab.py T REPEATS [PLANNERS]"""
import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "../../../.."))  # the checkout
import importlib.util, subprocess, sys, tempfile, time, collections, os
from selfspec.engine import round_costs, planner
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
T, reps = float(sys.argv[1]), int(sys.argv[2])
copies = int(sys.argv[3]) if len(sys.argv) > 3 else 1
src = subprocess.run(["git", "show", "bebd1ce:selfspec/engine/round_costs.py"], capture_output=True, text=True, check=True,
                     cwd=ROOT).stdout
with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(src)
spec = importlib.util.spec_from_file_location("round_costs_old", f.name)
old = importlib.util.module_from_spec(spec); sys.modules["round_costs_old"] = old; spec.loader.exec_module(old)
NAMES = ("seconds", "least_seconds", "_observe_time")
rules = {"wake": {n: getattr(round_costs.RoundCosts, n) for n in NAMES + ("wake_seconds",)},
         "head": {**{n: getattr(old.RoundCosts, n) for n in NAMES}, "wake_seconds": lambda self, *a: 0.0}}
model, tok = load(None, progress=False)
ps = read_prompts(os.path.join(ROOT, "benchmarks/tune_prompts.jsonl"))
variants = ["ar"] + [f"{r}{i}" for i in range(copies) for r in ("head", "wake")]
stores = {v: {} for v in variants}
def run(v):
    by = collections.Counter(); out = []
    mode = "ar" if v == "ar" else "auto"
    if v != "ar":
        for n, fn in rules[v.rstrip("0123456789")].items():
            setattr(round_costs.RoundCosts, n, fn)
        model.__dict__["_selfspec_planners"] = stores[v]
    for i, p in enumerate(ps):
        ids = encode_prompt(tok, p.get("prompt") or p["messages"])
        t0 = time.perf_counter(); toks = []
        for _, chunk in Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=128, temperature=T), seeds=[i]):
            toks += list(chunk)
        by["code" if "code" in p["id"] else "chat"] += time.perf_counter() - t0
        out.append(toks)
    return by, out
for v in variants:
    run(v)  # warm-up: each planner learns on the prompts once
tot = {v: collections.Counter() for v in variants}
ref = None
for r in range(reps):
    for v in (variants if r % 2 == 0 else variants[::-1]):
        by, out = run(v)
        tot[v].update(by)
        if v == "ar" and ref is None: ref = out
        if T == 0 and ref is not None and out != ref: print("DIFFERENT TOKENS", v)
for v in variants:
    t = tot[v]
    print(f"{v:6s} code {t['code']:.3f} s chat {t['chat']:.3f} s | auto/AR code {tot['ar']['code']/t['code']:.3f}x "
          f"chat {tot['ar']['chat']/t['chat']:.3f}x all {(tot['ar']['code']+tot['ar']['chat'])/(t['code']+t['chat']):.3f}x")
for v in variants[1:]:
    for key, pl in stores[v].items():
        w = getattr(pl, "wake", None)
        print(v, "wake", w if not isinstance(w, (dict, float)) else round(w, 3) if isinstance(w, float)
              else {k: round(x, 3) for k, x in sorted(w.items())}, "relative", {k: round(x, 3) for k, x in pl.relative.items()},
              "scale", {k: round(x, 3) for k, x in pl.scale.items()})
