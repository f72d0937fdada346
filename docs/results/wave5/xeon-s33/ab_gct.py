# Session 33: ab.py plus the seconds the cyclic GC's collections took per variant.
"""Where `auto` loses to AR when it runs AR every round (issue 39 at B >= 4): variants of one decode
of the 16 tune prompts, B rows at a time, 64 tokens, in a random order each repeat, one process.

    python docs/results/wave5/xeon-s32/floor_ab.py B REPEATS T VARIANTS

Variants (comma-separated; the first is the reference):
  ar                      mode "ar"
  ar-cap                  mode "ar" with the cache capacity auto reserves (63 more slots a row)
  auto                    mode "auto" as shipped
  auto-stub               auto whose planner returns a bare AR round every round and learns nothing
                          (no forecast, no observe: what remains is auto's decoder, cache and settings)
  auto-stub-nolk-norho    ... and no lookup index or n-gram rho kept per row
  auto-stub-nolora        ... and no draft LoRA loaded
  auto-quick              auto where, after a rest, one AR choice (not eight) starts the next rest,
                          until a bet is placed (tried, not kept: rest_ab.txt)
  auto-rest128            auto with rests of up to 128 rounds instead of 32 (tried, not kept)
Prints each variant's summed wall time, ref/this over the sums, and the median of the per-repeat ratios."""
import collections
import random
import statistics
import sys
import time

import selfspec.engine.decoder as decoder_mod
import selfspec.engine.planner as planner_mod
from selfspec.engine.decoder import Decoder
from selfspec.engine.layouts import AR
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts

B, reps, T, variants = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4].split(",")
import gc
gcn = collections.Counter()
GT = [0.0]
def _cb(phase, info):
    if phase == "start":
        GT[0] = time.perf_counter(); gcn[(CUR[0], info["generation"])] += 1
    else:
        gcn[(CUR[0], "secs")] += time.perf_counter() - GT[0]
gc.callbacks.append(_cb)
CUR = [None]
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
real_plan, real_observe, real_capacity = planner_mod.Planner.plan, planner_mod.Planner.observe, decoder_mod.row_capacity
real_note = planner_mod.Planner.note_choice


def bare_plan(self, rnd):
    self.predicted = None
    rnd.bare = True
    return AR


def quick_note(self, option):
    if option.speculative:
        self.ar_streak, self.rest, self.quick = 0, max(4, self.rest // 2), False
        return
    self.ar_streak += 1
    if self.ar_streak >= (1 if getattr(self, "quick", False) else 8):
        self.dormant, self.rest, self.ar_streak = self.rest, min(2 * self.rest, planner_mod.REST_MAX), 0
        self.quick = True


stores: dict = {}


def configure(v: str) -> DecodeConfig:
    # each variant keeps its own planners between its repeats (as generations with one setting do),
    # never another variant's: the model's store is keyed by the settings, which several variants share
    model.__dict__["_selfspec_planners"] = stores.setdefault(v, {})
    stub = "stub" in v
    planner_mod.Planner.plan = bare_plan if stub else real_plan
    planner_mod.Planner.observe = (lambda self, rnd: None) if stub else real_observe
    decoder_mod.row_capacity = (lambda *a, **k: real_capacity(*a, **k) + 63) if v == "ar-cap" else real_capacity
    kw = {}
    if "nolk" in v:
        kw["lookup"] = False
    if "norho" in v:
        kw["rho"] = "none"
    if "nolora" in v:
        kw["draft_lora"] = False
    planner_mod.REST_MAX = 256 if "rest256" in v else (128 if "rest128" in v else 32)
    planner_mod.Planner.note_choice = quick_note if "quick" in v else real_note
    return DecodeConfig(mode=v.rstrip("2").split("-")[0], max_new_tokens=64, temperature=T, **kw)


for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)):  # warm-up
    pass
random.seed(1)
wall = collections.defaultdict(list)
for _ in range(reps):
    order = variants[:]
    random.shuffle(order)
    for v in order:
        cfg = configure(v); CUR[0] = v
        t0 = time.perf_counter()
        for _ in Decoder(model, enc, cfg, batch_size=B, seeds=list(range(len(enc)))):
            pass
        wall[v].append(time.perf_counter() - t0)
ref = wall[variants[0]]
print(f"# B = {B}, T = {T}, {reps} repeats in random order")
for v in variants:
    ratios = [a / b for a, b in zip(ref, wall[v])]
    print(f"{v:22s} {sum(wall[v]):7.3f} s  {variants[0]}/this {sum(ref) / sum(wall[v]):.3f}  "
          f"per-repeat median {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
print("gc collections (variant, generation): count over all repeats")
for k in sorted(gcn, key=str):
    print(k, gcn[k])
