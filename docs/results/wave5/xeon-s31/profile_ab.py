"""auto / AR decode time on tune prompts with a given cost model file (`Decoder(profile=)`): the one
cached since an earlier session vs one measured now. One profile per process; alternate processes.
    python docs/results/wave5/xeon-s31/profile_ab.py PROFILE.json long|short"""
import os, sys
import selfspec
from selfspec.engine.cost import CostModel
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_runs  # noqa: E402
path, suite = sys.argv[1], sys.argv[2]
model, tok = selfspec.load(progress=False)
prof = CostModel.load(path)
tune_runs.run(model, tok, suite, path.rsplit("/", 1)[-1], reps=2, profile=prof, hist=True)
