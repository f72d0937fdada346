# run from the checkout root: TREE=<a checkout> python docs/results/wave5/xeon-s30/phases.py T MODE
import sys, time, collections, os
sys.path.insert(0, os.environ["TREE"])
import selfspec.engine.step as S, selfspec.engine.decoder as D, selfspec.engine.batch_forward as BF
from selfspec.loading import load
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts
T = float(sys.argv[1]); mode = sys.argv[2]
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
acc = collections.defaultdict(float)
def wrap(cls, name, label=None):
    real = getattr(cls, name); label = label or name
    def f(*a, **k):
        t0 = time.perf_counter(); r = real(*a, **k); acc[label] += time.perf_counter() - t0; return r
    setattr(cls, name, f)
for n in ("step", "plan", "draft", "forward", "verify_commit", "targets_of", "timed"): wrap(S.Stepper, n)
wrap(BF.BatchForward, "__call__", "bf_call"); wrap(BF.BatchForward, "logits", "bf_logits")
import selfspec.kernels.block as kb
real_entry = kb._entry()
def cfn(*a):
    t0 = time.perf_counter(); r = real_entry(*a); acc["C block"] += time.perf_counter() - t0; return r
kb._entry = lambda: cfn
rounds = 0; wall = 0.0
for i, ids in enumerate(enc):
    d = Decoder(model, [ids], DecodeConfig(mode=mode, max_new_tokens=128, temperature=T), seeds=[i])
    t0 = time.perf_counter()
    for _ in d: pass
    wall += time.perf_counter() - t0; rounds += d.stats[0].rounds
for k, v in sorted(acc.items(), key=lambda x: -x[1]): print(f"{k:14s} {v/rounds*1e6:8.1f} us/round")
print("wall/round", wall / rounds * 1e6, "rounds", rounds)
