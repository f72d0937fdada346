"""What this session's A/B and diagnosis scripts share (prior_ab.py, profile_ab.py, oracle_ab.py, round_kinds.py,
oracle_rounds.py): the planner variants they try (`patch_planner`), a log of `auto`'s rounds by kind (`round_log`)
and the loop (`run`): auto / AR decode time on tune prompts only, the long suite's tune half (eos off, 96 tokens,
T = 0) or benchmarks/tune_prompts.jsonl (64 tokens, T = 0 and 1), AR and auto alternating per prompt, decode
timed after the prefill's token as the bench does."""
import collections
import time

import torch

import selfspec.engine.planner as planner
from selfspec.engine.calibration import PositionCalibrator
from selfspec.engine.decoder import Decoder
from selfspec.engine.ledger import Ledger
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts, read_suite

# the lookup calibration's prior by match length tried ("new"): the tune prompts' rates, roughly
PRIORS = {1: 0.3, 2: 0.5, 3: 0.8}
# P(chain token j accepted | the ones before were) by match length ("oracle"): the long suite's ~1k tune prompts'
# greedy outputs replayed (the lookup index as the runtime's, chains of up to 10)
RATES = {1: [0.16, 0.23, 0.67, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
         2: [0.26, 0.53, 0.88, 0.71, 1.0, 1.0, 0.6, 1.0, 1.0, 1.0],
         3: [0.83, 0.90, 0.90, 0.93, 0.93, 0.94, 0.97, 0.97, 0.97, 0.97]}


class ByMatch(PositionCalibrator):
    """The runtime's lookup calibration with a prior by match length (`PRIORS`) instead of 0.5 flat."""

    def prob(self, n, match=1):
        reached, accepted = self._get(match)
        prior = PRIORS.get(match[0] if isinstance(match, tuple) else match, self.prior)
        return [(accepted[i] + self.a * prior) / (reached[i] + self.a) for i in range(min(n, self.positions))]


def patch_planner(variant):
    """Diagnoses, not rules: the planner as it is ("old", "base") or with parts joined by "+": "new" (priors by
    match length), "oracle" (the lookup calibration replaced by `RATES`), "funds" (every generation starts
    with 2 AR rounds of funds), "free" (a ledger that allows every bet), "norest" (never rests from forecasting)."""
    parts = set(variant.split("+"))
    if parts & {"new", "oracle"}:
        init = planner.Planner.__init__

        def init_patched(self, *a, **k):
            init(self, *a, **k)
            if "new" in parts:
                self.lookup_calibrator = ByMatch()
            else:
                self.lookup_calibrator.prob = lambda n, match=1: (
                    RATES.get(match[0] if isinstance(match, tuple) else match, [0.0] * 64) + [0.97] * 64)[:n]

        planner.Planner.__init__ = init_patched
    if "funds" in parts:
        planner.START_MIN = 2.0
    if "free" in parts:
        Ledger.may_bet = lambda self, loss, lookup=False: True
    if "norest" in parts:
        planner.Planner.note_choice = lambda self, option: None


def round_log(cost=None):
    """{kind: [(seconds, model seconds, planner seconds, tokens committed, cost model's seconds or None)]} of
    every round `auto` observes from now on; kind: the layout, "/bare" for a round without a forecast."""
    rows, real = collections.defaultdict(list), planner.Planner.observe

    def observe(self, rnd):
        kind = rnd.option.draft + "/" + str(rnd.option.nodes) + ("/bare" if rnd.bare else "")
        rows[kind].append((rnd.seconds, rnd.model_seconds, rnd.plan_seconds, len(rnd.rows[0].committed),
                           cost(1, rnd.width, rnd.cache_len) if cost else None))
        return real(self, rnd)

    planner.Planner.observe = observe
    return rows


def run(model, tok, suite, label, *, reps=1, profile=None, hist=False, length=None):
    if suite == "long":  # `length`: "1k" or "3k" only
        prompts, temps, new, no_eos = [p for p in read_suite("long") if p["split"] == "tune"
                                       and length in (None, p["length"])], [0.0], 96, {"eos_token_id": []}
    else:
        prompts, temps, new, no_eos = read_prompts("benchmarks/tune_prompts.jsonl"), [0.0, 1.0], 64, {}

    def decode(ids, mode, t, seed):
        gen = torch.Generator().manual_seed(seed)
        dec = Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=new, temperature=t), generators=[gen],
                      profile=profile if mode == "auto" else None, **no_eos)
        first = None
        for _ in dec:
            first = first or time.perf_counter()
        return list(dec.outputs[0]), time.perf_counter() - first, dec.stats[0]

    for t in temps:
        tot, by, plans = {"ar": 0.0, "auto": 0.0}, {}, {}
        for rep in range(reps):
            for i, p in enumerate(prompts):
                ids = encode_prompt(tok, p["prompt"])
                outs = {}
                for mode in (("ar", "auto") if (i + rep) % 2 == 0 else ("auto", "ar")):
                    outs[mode], dt, st = decode(ids, mode, t, i)
                    tot[mode] += dt
                    key = p.get("length", p["id"].rstrip("0123456789"))
                    by.setdefault(key, {"ar": 0.0, "auto": 0.0})[mode] += dt
                    if mode == "auto":
                        for k, v in st.plan_hist.items():
                            plans[k] = plans.get(k, 0) + v
                if t == 0 and outs["ar"] != outs["auto"]:
                    raise SystemExit(f"{p['id']}: auto's greedy output differs from AR's")
        line = f"{label} {suite} T={t}: auto/AR {tot['ar'] / tot['auto']:.3f} " + " ".join(
            f"{k} {v['ar'] / v['auto']:.3f}" for k, v in sorted(by.items()))
        if hist:
            line += f" | speculative rounds {sum(v for k, v in plans.items() if k != 'ar')} of {sum(plans.values())}"
        print(line, flush=True)
