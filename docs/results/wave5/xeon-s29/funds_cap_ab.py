"""auto with the most funds a generation inherits at several values, each with its own stored planners, against AR, in one process
(mirrored order); the tune prompts, 128 tokens. python eps_ab.py T REPEATS EPS..."""
import sys
from selfspec.engine import planner
from selfspec.loading import load
from tune_ab import alternate, generate, print_times, tune_prompts
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
ps = tune_prompts()
stores = {e: {} for e in epss}
def run(variant):
    if variant != "ar":
        cap["v"] = variant; model.__dict__["_selfspec_planners"] = stores[variant]
    return generate(model, tok, ps, "ar" if variant == "ar" else "auto", T)
variants = ["ar"] + epss
print_times(alternate(run, variants, reps, T), variants)
