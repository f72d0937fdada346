"""auto / AR decode time with the lookup calibrator's prior by match length (new: 0.3 / 0.5 / 0.8 after a 1- / 2-
/ 3-gram, the tune prompts' rates), 0.5 flat (old: the runtime's), either with 2 AR rounds of funds at every
generation's start (+funds), or a planner that never rests from forecasting (norest), on
tune prompts only: the long suite's tune half (eos off, 96 tokens) or benchmarks/tune_prompts.jsonl (64
tokens, T = 0 and 1). One variant per process; run processes alternately.
    python docs/results/wave5/xeon-s31/prior_ab.py old|new|old+funds|new+funds|norest long|short"""
import os, sys
import selfspec
import selfspec.engine.planner as planner
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_runs  # noqa: E402
variant, suite = sys.argv[1], sys.argv[2]
if variant.startswith("new"):  # the priors as a subclass here: not kept in the runtime
    from selfspec.engine.calibration import PositionCalibrator

    PRIORS = {1: 0.3, 2: 0.5, 3: 0.8}

    class ByMatch(PositionCalibrator):
        def prob(self, n, match=1):
            reached, accepted = self._get(match)
            prior = PRIORS.get(match[0] if isinstance(match, tuple) else match, self.prior)
            return [(accepted[i] + self.a * prior) / (reached[i] + self.a) for i in range(min(n, self.positions))]

    init = planner.Planner.__init__

    def init_by_match(self, *a, **k):
        init(self, *a, **k)
        self.lookup_calibrator = ByMatch()

    planner.Planner.__init__ = init_by_match
if variant == "norest":  # a diagnosis, not a rule: the planner never rests from forecasting
    planner.Planner.note_choice = lambda self, option: None
if variant.endswith("+funds"):  # a diagnosis, not a rule: every generation starts with 2 AR rounds of funds
    planner.START_MIN = 2.0
model, tok = selfspec.load(progress=False)
tune_runs.run(model, tok, suite, variant)
