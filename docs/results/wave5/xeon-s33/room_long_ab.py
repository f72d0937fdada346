"""Long contexts: plan "auto" with the new room (`request.round_room`) against the old (64 slots, padding up to
`scratch`) and AR, on the long suite's tune prompts of one length, one at a time, T given; variants in a random
order each repeat, one process.   python room_long_ab.py LENGTH REPEATS T MAX_NEW"""
import collections, json, random, sys, time
import selfspec.engine.planner as planner_mod
import selfspec.engine.request as request_mod
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.loading import load
from selfspec.streaming import encode_prompt

length, reps, T, new_tokens = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
model, tok = load(None, progress=False)
rows = [json.loads(l) for l in open(f"selfspec/data/long/{length}.jsonl")]
enc = [(r["id"], encode_prompt(tok, r.get("messages") or r["prompt"])) for r in rows if r["split"] == "tune"]
new_room = request_mod.round_room
old_room = lambda cfg: min(request_mod.scratch(cfg), request_mod.ROUND_SCRATCH)  # noqa: E731
stores: dict = {}
variants = ["ar", "auto-new", "auto-old"]
random.seed(1)
decode, hist, caps = collections.defaultdict(float), collections.defaultdict(collections.Counter), collections.defaultdict(set)
for _ in range(reps):
    for pid, ids in enc:
        order = variants[:]
        random.shuffle(order)
        for v in order:
            model.__dict__["_selfspec_planners"] = stores.setdefault(v, {})
            request_mod.round_room = old_room if v == "auto-old" else new_room
            planner_mod.round_room = (lambda cfg: request_mod.scratch(cfg)) if v == "auto-old" else new_room
            cfg = DecodeConfig(mode=v.split("-")[0], max_new_tokens=new_tokens, temperature=T)
            dec = Decoder(model, [ids], cfg, seeds=[0])
            it = iter(dec)
            next(it)  # the first token: prefill done
            t0 = time.perf_counter()
            for _ in it:
                pass
            decode[v] += time.perf_counter() - t0
            hist[v].update(dec.stats[0].plan_hist)
            caps[v].add(dec.cache.capacity - len(ids))
print(f"# {length}, T = {T}, {reps} repeats of {len(enc)} tune prompts, {new_tokens} new tokens; decode seconds (after the first token)")
for v in variants:
    print(f"{v:10s} decode {decode[v]:7.3f} s  ar/this {decode['ar'] / decode[v]:.3f}  capacity past the prompt {sorted(caps[v])}")
for v in variants[1:]:
    print(v, "rounds by layout:", dict(hist[v].most_common(6)))
