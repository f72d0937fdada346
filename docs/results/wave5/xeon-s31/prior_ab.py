"""auto / AR decode time with the lookup calibrator's prior by match length (new: 0.3 / 0.5 / 0.8 after a 1- / 2-
/ 3-gram, the tune prompts' rates), 0.5 flat (old: the runtime's), either with 2 AR rounds of funds at every
generation's start (+funds), or a planner that never rests from forecasting (norest), on
tune prompts only: the long suite's tune half (eos off, 96 tokens) or benchmarks/tune_prompts.jsonl (64
tokens, T = 0 and 1). One variant per process; run processes alternately.
    python docs/results/wave5/xeon-s31/prior_ab.py old|new|old+funds|new+funds|norest long|short"""
import os, sys
import selfspec
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_runs  # noqa: E402
variant, suite = sys.argv[1], sys.argv[2]
tune_runs.patch_planner(variant)
model, tok = selfspec.load(progress=False)
tune_runs.run(model, tok, suite, variant)
