"""auto / AR decode time with the lookup calibrator's prior by match length (new: 0.3 / 0.5 / 0.8 after a 1- / 2-
/ 3-gram, the tune prompts' rates), 0.5 flat (old: the runtime's), either with 2 AR rounds of funds at every
generation's start (+funds), or a planner that never rests from forecasting (norest), on
tune prompts only: the long suite's tune half (eos off, 96 tokens) or benchmarks/tune_prompts.jsonl (64
tokens, T = 0 and 1). One variant per process; run processes alternately.
    python docs/results/wave5/xeon-s31/prior_ab.py old|new|old+funds|new+funds|norest long|short"""
import sys, time
import torch
import selfspec
import selfspec.engine.planner as planner
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts, read_suite
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
if suite == "long":
    prompts, temps, new, no_eos = [p for p in read_suite("long") if p["split"] == "tune"], [0.0], 96, {"eos_token_id": []}
else:
    prompts, temps, new, no_eos = read_prompts("benchmarks/tune_prompts.jsonl"), [0.0, 1.0], 64, {}
def decode(ids, mode, t, seed):
    gen = torch.Generator().manual_seed(seed)
    dec = Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=new, temperature=t), generators=[gen], **no_eos)
    first = None
    for _ in dec:
        first = first or time.perf_counter()
    return list(dec.outputs[0]), time.perf_counter() - first, dec.stats[0]
for t in temps:
    tot = {"ar": 0.0, "auto": 0.0}
    by = {}
    for i, p in enumerate(prompts):
        ids = encode_prompt(tok, p["prompt"])
        outs = {}
        for mode in (("ar", "auto") if i % 2 == 0 else ("auto", "ar")):
            outs[mode], dt, st = decode(ids, mode, t, i)
            tot[mode] += dt
            key = p.get("length", p["id"].rstrip("0123456789"))
            by.setdefault(key, {"ar": 0.0, "auto": 0.0})[mode] += dt
        if t == 0 and outs["ar"] != outs["auto"]:
            raise SystemExit(f"{p['id']}: auto's greedy output differs from AR's")
    print(f"{variant} {suite} T={t}: auto/AR {tot['ar'] / tot['auto']:.3f} " +
          " ".join(f"{k} {v['ar'] / v['auto']:.3f}" for k, v in sorted(by.items())), flush=True)
