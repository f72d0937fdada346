"""auto with the wake charged (the working tree) against HEAD's round-cost rules (no wake), each with its own
stored planners, against AR, in one process (mirrored order): the tune prompts, 128 tokens, T.
python wake_ab.py T REPEATS [PLANNERS]"""
import importlib.util, subprocess, sys, tempfile
from selfspec.engine import round_costs
from selfspec.loading import load
from tune_ab import ROOT, alternate, generate, print_times, tune_prompts
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
ps = tune_prompts()
variants = ["ar"] + [f"{r}{i}" for i in range(copies) for r in ("head", "wake")]
stores = {v: {} for v in variants}
def run(v):
    if v != "ar":
        for n, fn in rules[v.rstrip("0123456789")].items():
            setattr(round_costs.RoundCosts, n, fn)
        model.__dict__["_selfspec_planners"] = stores[v]
    return generate(model, tok, ps, "ar" if v == "ar" else "auto", T)
print_times(alternate(run, variants, reps, T), variants)
for v in variants[1:]:
    for key, pl in stores[v].items():
        w = getattr(pl, "wake", None)
        print(v, "wake", w if not isinstance(w, (dict, float)) else round(w, 3) if isinstance(w, float)
              else {k: round(x, 3) for k, x in sorted(w.items())}, "relative", {k: round(x, 3) for k, x in pl.relative.items()},
              "scale", {k: round(x, 3) for k, x in pl.scale.items()})
