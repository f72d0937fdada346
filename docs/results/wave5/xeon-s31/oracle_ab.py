"""Where `auto` loses against a calibrated planner at ~1,000 tokens (a diagnosis, not a rule): auto / AR on the
long suite's ~1k tune prompts with the lookup calibration as it is (base), replaced by the tune prompts' own
acceptance rates by match length (oracle: what lookup_bound.py's calibrated planner knows, measured on these
prompts' AR outputs), or that and a ledger that allows every bet (oracle+free); a second argument plans with
that cost model file instead of the cached one. One variant a process.
    python docs/results/wave5/xeon-s31/oracle_ab.py base|oracle|oracle+free|oracle+free+norest [PROFILE.json]"""
import os, sys
import selfspec
import selfspec.engine.planner as planner
from selfspec.engine.ledger import Ledger
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_runs  # noqa: E402

# P(chain token j accepted | the ones before were), by match length: the long suite's ~1k tune prompts' greedy
# outputs replayed (the lookup index as the runtime's, chains of up to 10)
RATES = {1: [0.16, 0.23, 0.67, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
         2: [0.26, 0.53, 0.88, 0.71, 1.0, 1.0, 0.6, 1.0, 1.0, 1.0],
         3: [0.83, 0.90, 0.90, 0.93, 0.93, 0.94, 0.97, 0.97, 0.97, 0.97]}
variant = sys.argv[1]
if variant.startswith("oracle"):
    init = planner.Planner.__init__

    def init_oracle(self, *a, **k):
        init(self, *a, **k)
        cal = self.lookup_calibrator
        cal.prob = lambda n, match=1: (RATES.get(match[0] if isinstance(match, tuple) else match, [0.0] * 64) +
                                       [0.97] * 64)[:n]

    planner.Planner.__init__ = init_oracle
if "+free" in variant:
    Ledger.may_bet = lambda self, loss, lookup=False: True
if variant.endswith("+norest"):  # and it never rests from forecasting
    planner.Planner.note_choice = lambda self, option: None
from selfspec.engine.cost import CostModel  # noqa: E402
prof = CostModel.load(sys.argv[2]) if len(sys.argv) > 2 else None
model, tok = selfspec.load(progress=False)
tune_runs.run(model, tok, "long", variant + (" " + os.path.basename(sys.argv[2]) if prof else ""), hist=True,
              length="1k", profile=prof)
