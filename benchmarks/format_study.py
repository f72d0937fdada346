"""What a flatter w4a8 would cost in quality: candidate grids simulated on the default model.

    python benchmarks/format_study.py --limit 8 --tokens 64

Why: w4a8 scales every block of 32 products in float (its weights' scale and minimum per block,
the activations' scale per row and block), so each row pays ~6 vector instructions per block and
16 outputs after its integer sums, and a round of 8-16 tokens costs 1.7-2.9 one-token forwards
(issue 38 asks <= 1.25 at 8). A format whose integer sums could run on across blocks (AMX tiles,
VNNI, one float step per larger group) needs the blocks' scales as integer multiples of one scale
per group of 192 inputs, for the weights (sub-scales) and for the activations. This measures
what that costs before anyone builds it: each candidate's weights are quantized and dequantized
in place (fp32) and its activations rounded per row and group by a hook on every projection
(the w8a8 head as the runtime has it), then top-1 agreement with fp32 and KL(fp32 || candidate)
per token over fp32's greedy continuations of the default prompts (teacher-forced), as
`benchmarks/formats.py` scores the formats. The rows:

* "Q4_1/32, act/32": today's w4a8 grid (the reference);
* "Q4_1/32, act/192": the activations' scale per 192 instead of per 32;
* "sub-scales B-bit, asym/192, act/32": 4-bit weights with a scale and a minimum per 32, each an
  integer of B bits times one fp16 factor per 192 (Q4_K's idea); "sym": no minimum.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def q4_1(w: torch.Tensor) -> torch.Tensor:
    """w4a8's weight grid: per 32, q in 0..15 times an fp16 step plus an fp16 minimum."""
    n, k = w.shape
    b = w.view(n, k // 32, 32)
    lo, hi = b.min(-1, keepdim=True).values, b.max(-1, keepdim=True).values
    s, m = ((hi - lo) / 15).half().float(), lo.half().float()
    q = torch.where(s > 0, ((b - m) / s).round().clamp(0, 15), torch.zeros_like(b))
    return (q * s + m).view(n, k)


def sub_scales(w: torch.Tensor, bits: int, asym: bool, group: int = 192) -> torch.Tensor:
    """4-bit weights per 32 whose step (and minimum, `asym`) is an integer of `bits` bits times one
    fp16 factor per `group` inputs."""
    n, k = w.shape
    top = 2 ** bits - 1
    b = w.view(n, k // group, group // 32, 32)
    if asym:
        lo, hi = b.min(-1, keepdim=True).values, b.max(-1, keepdim=True).values
        s = (hi - lo) / 15
        d = (s.amax(2, keepdim=True) / top).half().float()
        dm = (lo.abs().amax(2, keepdim=True) / top).half().float()
        step = torch.where(d > 0, (s / d).round().clamp(1, top), torch.ones_like(s)) * d
        low = torch.where(dm > 0, (lo / dm).round().clamp(-top, top), torch.zeros_like(lo)) * dm
        q = torch.where(step > 0, ((b - low) / step).round().clamp(0, 15), torch.zeros_like(b))
        return (q * step + low).view(n, k)
    s = b.abs().amax(-1, keepdim=True) / 7
    d = (s.amax(2, keepdim=True) / top).half().float()
    step = torch.where(d > 0, (s / d).round().clamp(1, top), torch.ones_like(s)) * d
    q = torch.where(step > 0, (b / step).round().clamp(-8, 7), torch.zeros_like(b))
    return (q * step).view(n, k)


def act_round(x: torch.Tensor, group: int) -> torch.Tensor:
    """x rounded as w4a8 quantizes activations (int8, scale amax / 127), per row and `group`."""
    shape, k = x.shape, x.shape[-1]
    g = x.reshape(-1, k // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, (g * (127 / amax)).round(), torch.zeros_like(g))
    return (q * (amax / 127)).reshape(shape)


CANDIDATES = {
    "Q4_1/32, act/32": (q4_1, 32),
    "Q4_1/32, act/192": (q4_1, 192),
    "sub-scales 4-bit, sym/192, act/32": (lambda w: sub_scales(w, 4, False), 32),
    "sub-scales 4-bit, asym/192, act/32": (lambda w: sub_scales(w, 4, True), 32),
    "sub-scales 6-bit, asym/192, act/32": (lambda w: sub_scales(w, 6, True), 32),
    "sub-scales 8-bit, asym/192, act/32": (lambda w: sub_scales(w, 8, True), 32),
    "sub-scales 8-bit, asym/192, act/192": (lambda w: sub_scales(w, 8, True), 192),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=8, help="the first N default prompts")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args()
    import selfspec
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine.decoder import generate_ids
    from selfspec.engine.formats import clone
    from selfspec.engine.options import DecodeConfig
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_prompts
    from selfspec.tools.peers import causal_lm

    base, tok = selfspec.load(weights="fp32", progress=False)
    prompts = [encode_prompt(tok, p["prompt"])
               for p in read_prompts(os.path.join(default_model_dir(), "prompts.jsonl"))[: a.limit]]
    conts = [generate_ids(base, p, DecodeConfig(mode="ar", max_new_tokens=a.tokens), eos_token_id=[])[0]
             for p in prompts]
    ref = causal_lm(base)

    def candidate(weights, group):
        m = clone(base)
        for layer in m.encoder.layers:
            for mod in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                with torch.no_grad():
                    mod.weight.copy_(weights(mod.weight.float()))
                mod.register_forward_pre_hook(lambda _, args, g=group: (act_round(args[0], g),))
        head = m.diffusion_head  # w8a8: int8 per output, activations per 32
        with torch.no_grad():
            s = head.weight.abs().amax(1, keepdim=True) / 127
            head.weight.copy_((head.weight / s).round() * s)
        head.register_forward_pre_hook(lambda _, args: (act_round(args[0], 32),))
        return causal_lm(m)

    records = {}
    with torch.no_grad():
        for name, (weights, group) in CANDIDATES.items():
            lm, agree, kl, n = candidate(weights, group), 0.0, 0.0, 0
            for p, c in zip(prompts, conts):
                ids = torch.tensor([p + c[:-1]])
                lp = ref(ids).logits[0, len(p) - 1:].float().log_softmax(-1)
                lq = lm(ids).logits[0, len(p) - 1:].float().log_softmax(-1)
                agree += float((lp.argmax(-1) == lq.argmax(-1)).sum())
                kl += float((lp.exp() * (lp - lq)).sum())
                n += lp.shape[0]
            records[name] = {"agreement": round(agree / n, 4), "kl": round(kl / n, 5)}
            print(f"{name:38s} top-1 agreement {agree / n:.4f}  KL {kl / n:.5f}", flush=True)
    print(json.dumps({"command": "python benchmarks/format_study.py " + " ".join(sys.argv[1:]), "tokens": n,
                      "candidates": records}))


if __name__ == "__main__":
    main()
