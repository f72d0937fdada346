"""auto where a bet that did not pay for the forecasts since the previous bet lengthens the planner's next rest
(instead of halving it), against today's rule, each its own planners, against AR, one process (mirrored order):
the tune prompts of KIND, 128 tokens, T. python roi_ab.py T REPEATS PLANNERS KIND"""
import sys
from selfspec.engine import planner as P
from selfspec.engine.layouts import AR
from selfspec.loading import load
from tune_ab import alternate, generate, tune_prompts
T, reps, copies, kind = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else ""
real_account, real_note = P.Planner._account, P.Planner.note_choice
on = {"v": False}
def account(self, seen):
    if not on["v"]:
        return real_account(self, seen)
    before = self.ledger.won
    real_account(self, seen)
    gain = self.ledger.won - before  # this round's gain (negative: loss), AR rounds
    if seen.option is AR:
        if not seen.bare:
            self.__dict__["fc_spent"] = self.__dict__.get("fc_spent", 0.0) - gain
    else:
        if gain < self.__dict__.get("fc_spent", 0.0):  # did not pay for its forecasts: no shorter rest
            self.rest = min(2 * self.__dict__.get("rest_before", self.rest), P.REST_MAX)
        self.__dict__["fc_spent"] = 0.0
def note(self, option):
    self.__dict__["rest_before"] = self.rest
    real_note(self, option)
P.Planner._account, P.Planner.note_choice = account, note
model, tok = load(None, progress=False)
ps = tune_prompts(kind)
variants = ["ar"] + [f"{r}{i}" for i in range(copies) for r in ("head", "roi")]
stores = {v: {} for v in variants}
def run(v):
    on["v"] = v.startswith("roi")
    if v != "ar":
        model.__dict__["_selfspec_planners"] = stores[v]
    return generate(model, tok, ps, "ar" if v == "ar" else "auto", T)
tot = alternate(run, variants, reps, T)
for v in variants:
    t = tot[v]
    a = sum(tot["ar"].values()) / sum(t.values())
    print(f"{v:6s} " + " ".join(f"{k} {tot['ar'][k] / t[k]:.3f}x" for k in sorted(t)) + f" all {a:.3f}x")
