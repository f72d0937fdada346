"""Does a machine that gets faster while auto bets make wrong chains look like wins? Fake clock:
every forward costs 2x the CPU cost model until SWITCH seconds, 1x after; lookup chains are the
reference's next tokens (right) before SWITCH and wrong after. Prints auto's fake time after the
switch against AR's over the same tokens, and its layouts after the switch."""
import collections, sys
import torch
sys.path.insert(0, "tests")  # run from the repository root: the tests' fake clock and priced forward
from conftest import FakeClock, PricedForward, tiny_model
import selfspec.engine.planner as planner_mod
from selfspec.engine.decoder import Decoder
from selfspec.engine.options import DecodeConfig
from selfspec.engine.sequence import lookup_chain
from test_floor import CPU, _model_and_prompt

N, SWITCH, SLOW = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

def run(m, prompt, cfg, reference=None):
    m.__dict__.pop("_selfspec_planners", None)
    dec = Decoder(m, [prompt], cfg, eos_token_id=[], profile=CPU)
    clock = FakeClock()
    dec.stepper.clock = clock
    price = lambda R, q, c: CPU(R, q, c) * (SLOW if clock.t < SWITCH else 1.0)
    dec.bf = dec.stepper.bf = PricedForward(dec.stepper.bf, clock, price)
    after = collections.Counter()
    if reference is not None:
        ref_list = reference + [5] * 64
        def chain(seq, cfg, room):
            seq.match = 3
            right = ref_list[len(seq.emitted): len(seq.emitted) + min(10, room - 1)]
            return right if clock.t < SWITCH else [5 + (t - 4) % 11 for t in right]
        planner_mod.lookup_chain = chain
        dec.on_round = lambda info: after.update([info["layout"]]) if clock.t >= SWITCH else None
    marks = {}
    try:
        for _ in dec:
            if clock.t >= SWITCH and "t" not in marks:
                marks["t"], marks["n"] = clock.t, len(dec.outputs[0])
    finally:
        planner_mod.lookup_chain = lookup_chain
    return dec.outputs[0], clock.t, marks, after, dec.planner

m, prompt = _model_and_prompt()
ar, ar_t, ar_marks, _, _ = run(m, prompt, DecodeConfig(mode="ar", max_new_tokens=N))
out, t, marks, after, pl = run(m, prompt, DecodeConfig(mode="auto", max_new_tokens=N), reference=ar)
assert out == ar
print(f"AR: {ar_t:.3f} s in all, switch at token {ar_marks.get('n')}; auto: {t:.3f} s, switch at token {marks.get('n')}")
ar_after = (ar_t - ar_marks["t"]) / (N - ar_marks["n"])
auto_after = (t - marks["t"]) / (N - marks["n"])
print(f"after the switch: AR {ar_after * 1e3:.2f} ms a token, auto {auto_after * 1e3:.2f} ms a token -> auto/AR speed {ar_after / auto_after:.3f}")
print("auto's layouts after the switch:", dict(after.most_common(6)))
print("scale", {k: round(v, 3) for k, v in pl.scale.items()}, "relative", {k: round(v, 3) for k, v in pl.relative.items()}, "funds", round(pl.ledger.funds, 2))
