"""The layering: lower modules never import the tools built on them (bench, CLI, training,
predictor collection), directly or through each other."""

import subprocess
import sys

UPPER = ["selfspec.bench", "selfspec.cli", "selfspec.train", "selfspec.predictor", "selfspec.data",
         "selfspec.evaluate", "selfspec.peers", "selfspec.trace"]
LOWER = ["selfspec.tree", "selfspec.masks", "selfspec.scoring", "selfspec.learned_rho", "selfspec.cache",
         "selfspec.forward", "selfspec.planner", "selfspec.stats", "selfspec.calibration", "selfspec.lookup", "selfspec.verify", "selfspec.sampling",
         "selfspec.runtime", "selfspec.streaming", "selfspec.model", "selfspec.profile"]


def test_lower_modules_pull_in_no_upper_module():
    # one fresh interpreter imports every lower module; none may have brought an upper one along
    code = f"import sys, importlib; [importlib.import_module(m) for m in {LOWER!r}]; " \
           f"print([m for m in {UPPER!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_check_above_sees_an_upper_import():
    code = f"import sys, selfspec.bench; print([m for m in {UPPER!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "selfspec.bench" in out
