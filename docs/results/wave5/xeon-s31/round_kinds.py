"""Rounds of `auto` by kind on the long suite's tune half at one length (priors by match length and 2 AR rounds of
funds at each start, so that it bets): measured round seconds (median; the model's share; the planner's), the
cost model's prediction for its width, committed tokens. python docs/results/wave5/xeon-s31/round_kinds.py 1k|3k"""
import sys, collections, statistics
import selfspec
import selfspec.engine.planner as P
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_suite
from selfspec.engine.cost import cost_model
P.LOOKUP_PRIORS = {1: 0.3, 2: 0.5, 3: 0.8}
_orig_init = P.Planner.__init__
from selfspec.engine.calibration import PositionCalibrator
class PriorCal(PositionCalibrator):
    def prob(self, n, match=1):
        reached, accepted = self._get(match)
        prior = P.LOOKUP_PRIORS.get(match[0] if isinstance(match, tuple) else match, self.prior)
        return [(accepted[i] + self.a * prior) / (reached[i] + self.a) for i in range(min(n, self.positions))]
def init(self, *a, **k):
    _orig_init(self, *a, **k); self.lookup_calibrator = PriorCal()
P.Planner.__init__ = init
P.START_MIN = 2.0
model, tok = selfspec.load(progress=False)
cost = cost_model(model)
ps = [p for p in read_suite("long") if p["split"] == "tune" and p["length"] == sys.argv[1]]
rows = collections.defaultdict(list)
real = P.Planner.observe
def observe(self, rnd):
    r = rnd.rows[0]
    kind = rnd.option.draft + "/" + str(rnd.option.nodes) + ("/bare" if rnd.bare else "")
    rows[kind].append((rnd.seconds, rnd.model_seconds, rnd.plan_seconds, len(r.committed), cost(1, rnd.width, rnd.cache_len)))
    return real(self, rnd)
P.Planner.observe = observe
for rep in range(2):
    for p in ps:
        ids = encode_prompt(tok, p["prompt"])
        dec = Decoder(model, [ids], DecodeConfig(mode="auto", max_new_tokens=96), eos_token_id=[])
        for _ in dec: pass
for k, v in sorted(rows.items()):
    md = lambda i: statistics.median(x[i] for x in v) * 1e3
    print(f"{k:14s} n {len(v):4d} round {md(0):6.2f} ms model {md(1):6.2f} plan {md(2):5.2f} cost-model {md(4):6.2f} committed mean {statistics.mean(x[3] for x in v):.2f}")
