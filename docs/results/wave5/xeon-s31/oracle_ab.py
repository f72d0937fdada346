"""Where `auto` loses against a calibrated planner at ~1,000 tokens (a diagnosis, not a rule): auto / AR on the
long suite's ~1k tune prompts with the lookup calibration as it is (base), replaced by the tune prompts' own
acceptance rates by match length (oracle: what lookup_bound.py's calibrated planner knows, measured on these
prompts' AR outputs), or that and a ledger that allows every bet (oracle+free); a second argument plans with
that cost model file instead of the cached one. One variant a process.
    python docs/results/wave5/xeon-s31/oracle_ab.py base|oracle|oracle+free|oracle+free+norest [PROFILE.json]"""
import os, sys
import selfspec
from selfspec.engine.cost import CostModel
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_runs  # noqa: E402

variant = sys.argv[1]
tune_runs.patch_planner(variant)  # "base", "oracle", "oracle+free", "oracle+free+norest"
prof = CostModel.load(sys.argv[2]) if len(sys.argv) > 2 else None
model, tok = selfspec.load(progress=False)
tune_runs.run(model, tok, "long", variant + (" " + os.path.basename(sys.argv[2]) if prof else ""), hist=True,
              length="1k", profile=prof)
