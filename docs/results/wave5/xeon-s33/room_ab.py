"""plan "auto" with the room its usual rounds take (new, `request.round_room`) against the room of its
widest round up to 64 slots and padding up to `scratch` (old), and AR: the 16 tune prompts, B rows,
64 tokens, variants in a random order each repeat, one process.
    python room_ab.py B REPEATS T"""
import collections, random, statistics, sys, time
import selfspec.engine.planner as planner_mod
import selfspec.engine.request as request_mod
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt
from selfspec.tools.bench_prompts import read_prompts

B, reps, T = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
model, tok = load(None, progress=False)
enc = [encode_prompt(tok, p.get("prompt") or p["messages"]) for p in read_prompts("benchmarks/tune_prompts.jsonl")]
new_room = request_mod.round_room
old_room = lambda cfg: min(request_mod.scratch(cfg), request_mod.ROUND_SCRATCH)  # noqa: E731
stores: dict = {}
variants = ["ar", "auto-new", "auto-old"]
for _ in Decoder(model, enc[:2], DecodeConfig(mode="ar", max_new_tokens=4)):
    pass
random.seed(1)
wall, hist = collections.defaultdict(list), collections.defaultdict(collections.Counter)
for _ in range(reps):
    order = variants[:]
    random.shuffle(order)
    for v in order:
        model.__dict__["_selfspec_planners"] = stores.setdefault(v, {})
        request_mod.round_room = old_room if v == "auto-old" else new_room
        planner_mod.round_room = (lambda cfg: request_mod.scratch(cfg)) if v == "auto-old" else new_room
        cfg = DecodeConfig(mode=v.split("-")[0], max_new_tokens=64, temperature=T)
        dec = Decoder(model, enc, cfg, batch_size=B, seeds=list(range(len(enc))))
        t0 = time.perf_counter()
        for _ in dec:
            pass
        wall[v].append(time.perf_counter() - t0)
        for s in dec.stats:
            hist[v].update(s.plan_hist)
ref = wall["ar"]
print(f"# B = {B}, T = {T}, {reps} repeats in random order")
for v in variants:
    ratios = [a / b for a, b in zip(ref, wall[v])]
    print(f"{v:10s} {sum(wall[v]):7.3f} s  ar/this {sum(ref) / sum(wall[v]):.3f}  per-repeat median "
          f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})")
for v in variants[1:]:
    print(v, "rounds by layout:", dict(hist[v].most_common(8)))
