"""Weight formats of a loaded model: `set_weights(model, "int4")`, and `weights="auto"`'s choice.

    fp32   the checkpoint's weights, fp32 activations (SDPA; a row's logits may move in their
           last bits with the round's width, as in transformers)
    bf16   bf16 weights and activations
    int8   int8 per-channel weights (`checkpoint.quant`), bf16 activations
    int4   int4 weights in groups of 32 (int8 where the kernel cannot take a shape: the tied
           output head of the default model), bf16 activations
    w4a8   4-bit weights (Q4_1's grid) times activations quantized per block of 32 to int8
           (`selfspec.kernels.w4a8`: integer dot products, one pass over the weights for all rows)

bf16, int8, int4 and w4a8 run the width-invariant forward on a CPU: attention sums exactly
(`attention.py`) and the int8 / int4 / w4a8 kernels are bitwise the same for a row at any number of
rows, so a row's logits do not depend on the round's width, tree or batch, and greedy output
equals AR greedy output by construction. bf16's `F.linear` is invariant only on CPUs without
native bf16 dot products (`invariant` probes it; "auto" drops a format that fails, and
`selfspec.load(weights="bf16")` warns there). On CUDA only fp32 / bf16 / fp16 exist, with SDPA.

"auto" (`choose`): the format with the fastest rounds (widths 1 and 8) on this device among those
whose forward is width-invariant and whose quality check passes: top-1 agreement with fp32 of at
least `MIN_AGREEMENT` over a built-in probe text (teacher-forced) and a mean KL below `MAX_KL`.
Measured once per device, model and torch version (a progress bar shows) and cached beside the cost models; the file says what was measured.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import sys

import torch

from selfspec.checkpoint.quant import FORMATS, INT_FORMATS, attach, quantize
from selfspec.engine.measure.device_id import cache_dir, device_key, model_key
from selfspec.engine.forward.forward import FastForward
from selfspec.kernels.build import sources_key

MIN_AGREEMENT = 0.9
MAX_KL = 0.1
PROBE = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
         "        a, b = b, a + b\n    return a\n\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
         "    def push(self, item):\n        self.items.append(item)\n\n"
         "The water cycle moves water between the oceans, the air and the land. The sun warms the sea, "
         "water evaporates, rises as vapour, cools into clouds and falls again as rain or snow. Rivers carry "
         "it back to the sea, and the cycle starts over. Plants take part too: their leaves release water.")


def set_weights(model, fmt: str):
    """Put `model` (in place) in weight format `fmt`; returns it. Quantizes from the model's
    current weights (load in fp32 first: the default model's fp32 weights are its GGUF's grid)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS} or 'auto'")
    model.__dict__.pop("selfspec_weights", None)
    if fmt == "fp32":
        return model.to(torch.float32)
    packed = None
    if fmt in INT_FORMATS:
        if any(p.device.type != "cpu" for p in model.parameters()):
            raise ValueError(f"{fmt} weights run on torch's CPU kernels; this model is not on the CPU")
        packed = {name: quantize(w, fmt, head=name == "diffusion_head.weight") for name, w in _linears(model)}
    model.to(torch.bfloat16)
    if packed is not None:
        attach(model, fmt, packed)
    return model


def clone(model):
    """A deep copy of `model` without the runtime state kept on it (compact forward, planners,
    cost model, packed weights): a copy to put in another format."""
    kept = {k: model.__dict__.pop(k) for k in list(model.__dict__) if k.startswith(("_selfspec", "selfspec_"))}
    try:
        return copy.deepcopy(model)
    finally:
        model.__dict__.update(kept)


def _linears(model):
    """(name, weight) of every matmul the compact forward runs, q/k/v and gate/up fused as it fuses
    them (`forward.FastForward`), in the model's current dtype."""
    for i, layer in enumerate(model.encoder.layers):
        at, mlp, pre = layer.self_attn, layer.mlp, f"encoder.layers.{i}."
        yield pre + "qkv", torch.cat([at.q_proj.weight, at.k_proj.weight, at.v_proj.weight]).detach()
        yield pre + "self_attn.o_proj.weight", at.o_proj.weight.detach()
        yield pre + "gate_up", torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
        yield pre + "mlp.down_proj.weight", mlp.down_proj.weight.detach()
    yield "diffusion_head.weight", model.diffusion_head.weight.detach()


# -- auto ------------------------------------------------------------------------------------------------
def choose(model, probe_ids: torch.Tensor, *, progress: bool = True, candidates=FORMATS) -> str:
    """The fastest format that passes the checks on this device (see the module docstring), from
    the cache or measured now on copies of `model` (an fp32 model; it is left as it is) with
    `probe_ids` (the probe text in the model's tokenizer) as the quality check's text."""
    path = _cache_path(model)
    if os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                return _pick(json.load(f)["formats"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: measured again
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "bf16"
    from selfspec.engine.measure.cost import beside_others

    report, others = beside_others(lambda: measure(model, probe_ids, candidates=candidates, progress=progress))
    if others is not None:  # times taken beside other work: this process's choice only (as `cost.cost_model`)
        print(f"selfspec: other processes kept {others:.1f} of this machine's cores busy while the weight formats "
              f"were timed: the choice serves this process only and is timed again next time", file=sys.stderr)
        return _pick(report)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"device": device_key(torch.device("cpu")), "torch": torch.__version__, "formats": report}, f,
                      indent=1)
        os.replace(path + ".tmp", path)
    except OSError:
        pass  # kept in memory only
    return _pick(report)


def cached_choice(model) -> tuple[str | None, str]:
    """(the format `choose` would take from its cache for `model` with the kernels as they load
    now, the cache file); None where it is not measured yet. Measures nothing."""
    path = _cache_path(model)
    try:
        with open(path, encoding="utf-8") as f:
            return _pick(json.load(f)["formats"]), path
    except (OSError, ValueError, KeyError, TypeError):
        return None, path


def _pick(report: dict) -> str:
    """The fastest exact format that passes the quality check; fp32 when none does."""
    ok = [f for f, r in report.items() if passes(r)]
    return min(ok, key=lambda f: report[f]["seconds"]) if ok else "fp32"


def passes(r: dict) -> bool:
    return r["invariant"] and r["agreement"] >= MIN_AGREEMENT and r["kl"] <= MAX_KL


def _cache_path(model) -> str:
    key = hashlib.sha1(f"{device_key(torch.device('cpu'))}|{model_key(model)}|{torch.__version__}|"
                       f"{_weights_digest(model)}|{','.join(FORMATS)}|rounds|{sources_key()}".encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{key}-formats.json")


def _weights_digest(model) -> str:
    h = hashlib.sha1()
    for _, p in sorted(model.named_parameters())[:8]:
        h.update(f"{tuple(p.shape)}:{float(p.detach().float().abs().sum()):.6e}".encode())
    return h.hexdigest()[:12]


def measure(model, probe_ids: torch.Tensor, *, candidates=FORMATS, progress: bool = True) -> dict:
    """Per format: seconds of a round (`_round_seconds`: widths 1 and 8 over 128 cached tokens), whether a
    row's logits are bitwise the same alone, in a width-6 tree and beside another row, and the
    top-1 agreement and mean KL against fp32 on the probe text (teacher-forced)."""
    from tqdm import tqdm

    ids = probe_ids
    ref = None
    out = {}
    for fmt in tqdm(candidates, desc="measuring weight formats", file=sys.stderr, disable=not progress, leave=False):
        m = set_weights(clone(model), fmt)
        logits = _logits(m, ids)
        if ref is None:
            ref = logits if fmt == "fp32" else _logits(set_weights(clone(model), "fp32"), ids)
        lp, lq = ref.log_softmax(-1), logits.log_softmax(-1)
        out[fmt] = {"seconds": _round_seconds(m), "invariant": invariant(m),
                    "agreement": round(float((lp.argmax(-1) == lq.argmax(-1)).float().mean()), 4),
                    "kl": round(float((lp.exp() * (lp - lq)).sum(-1).mean()), 5)}
    return out


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from selfspec.engine.forward.batch_forward import BatchForward

    bf = BatchForward.of(model)
    cache = bf.new_cache(1, len(ids) + 1)
    h = bf(ids[None], torch.arange(len(ids))[None], cache, slice(0, 1), causal=True)
    return bf.logits(h[0]).float()


def _round_seconds(model, cached: int = 128) -> float:
    """The mean of a width-1 and a width-8 forward's seconds over `cached` tokens (fastest of 7
    each, after a warm-up, `cost.best_of_sweeps`): a decode step and a typical verification round,
    since `auto` runs both (a format that is fast at one row only, like torch's int4 kernel past 4 rows, is not the
    fastest for speculation)."""
    from selfspec.engine.forward.batch_forward import BatchForward
    from selfspec.engine.measure.cost import best_of_sweeps

    bf = BatchForward.of(model)
    cache = bf.new_cache(1, cached + 10)
    ids = torch.arange(cached) % 100 + 5
    bf(ids[None], torch.arange(cached)[None], cache, slice(0, 1), causal=True)
    cache.set_length(0, cached)

    def run(w: int) -> None:
        block = torch.full((w, w), float("-inf")).triu(1)[None]
        bf.logits(bf((torch.arange(w) + 7)[None], torch.arange(w)[None], cache, slice(0, 1), block=block)[0])

    out = best_of_sweeps([1, 8], run, sweeps=1, budget_s=1e9, desc="", progress=False, settle=1, timed=7)
    return sum(out) / 2


def invariant(model) -> bool:
    """A row's logits bitwise the same alone (width 1), at the root of a width-6 chain, and in a
    batch beside a longer row of another width: what greedy equality with AR rests on."""
    from selfspec.engine.forward.batch_forward import BatchForward

    bf = BatchForward.of(model)
    g = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    p0, p1 = torch.randint(5, V, (40,), generator=g), torch.randint(5, V, (57,), generator=g)
    cache = bf.new_cache(2, 80)
    for r, p in enumerate((p0, p1)):
        bf(p[None], torch.arange(len(p))[None], cache, slice(r, r + 1), causal=True)
        cache.set_length(r, len(p))
    tok = torch.randint(5, V, (6,), generator=g)
    alone = bf.logits(bf(tok[None, :1], torch.zeros(1, 1, dtype=torch.long), cache, slice(0, 1))[0])
    causal = torch.full((6, 6), float("-inf")).triu(1)
    chain = bf.logits(bf(tok[None], torch.arange(6)[None], cache, slice(0, 1), block=causal[None])[0, :1])
    toks = torch.stack([tok, torch.randint(5, V, (6,), generator=g)])
    block = torch.stack([torch.full((6, 6), float("-inf")).fill_diagonal_(0.0), causal])
    block[0, 0, 0] = 0.0
    batch = bf.logits(bf(toks, torch.arange(6).expand(2, 6), cache, slice(0, 2), block=block)[0, :1])
    return bool(torch.equal(alone, chain) and torch.equal(alone, batch))
