"""`selfspec profile --project PROFILE`: what a model of this shape would decode at on this device.

f(width) (one forward of `width` query tokens over a cache, `engine.cost.measure`) is printed
beside the bytes of weights a forward reads and the process's peak resident memory (VmHWM), then
tokens per second projected from f and a replay profile's expected acceptance (`drafting.replay`):

* AR: 1 / f(1);
* linear self-speculation at block b: TPF_b / f(b), TPF_b = the profile's expected tokens per
  round with b - 1 drafts (`ReplayProfile.expected_tpf`);
* PRESTO at budget N: tau_N / f(N + 1), tau_N = the expected commits of the best tree of N nodes
  over the top-2 candidates (`ReplayProfile.expected_tree_tau`).

Those assume a round is one forward of its tree's width (the published TPF's accounting, which
counts a fused draft-and-verify forward once). Beside them, what selfspec's own fixed layouts pay
per round on the same curve (`CostModel.ar_steps`): two-pass (a draft forward of the block, then
the tree) and one-pass (the tree and a mask group on every node, one forward; far wider than the
measured widths, so extrapolated). Time outside the forward is not counted. Every projected figure
is labelled with the profile, and with "synthetic weights" for a synthetic model: its acceptance
is the profile's, never the model's own.
"""

from __future__ import annotations

import dataclasses

LINEAR_BLOCKS = (8, 16, 32)
PRESTO_BUDGETS = (8, 16, 32, 64)
PRESTO_BLOCK = 32  # PRESTO's block: the deepest a tree reaches is PRESTO_BLOCK - 1
WIDTHS = (1, 2, 4, 8, 16, 32, 64)
CACHE = 512  # cached tokens the curve is measured over (one length: the projection's)


def label(profile: str, synthetic: bool) -> str:
    return f"projected from replayed acceptance (profile {profile}){', synthetic weights' if synthetic else ''}"


def _nbytes(w) -> int:
    import torch

    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    parts = [getattr(w, f.name) for f in dataclasses.fields(w)] if dataclasses.is_dataclass(w) else vars(w).values()
    return sum(_nbytes(p) for p in parts if isinstance(p, torch.Tensor))


def weight_bytes(model) -> int:
    """Bytes of the weights one forward reads: every layer's matrices and the output head in the
    model's format (packed, or the modules' own); the embedding (a lookup) and the draft LoRA aside."""
    packed = model.__dict__.get("selfspec_weights")
    if packed is not None:
        return sum(_nbytes(w) for w in packed.weights.values())
    total = _nbytes(model.diffusion_head.weight)
    for layer in model.encoder.layers:
        at, mlp = layer.self_attn, layer.mlp
        total += sum(_nbytes(m.weight) for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj,
                                                 mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return total


def peak_memory_bytes() -> int | None:
    """This process's peak resident memory (VmHWM), or None where /proc has none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _layouts(profile):
    """(name, tau, tree width, selfspec's two-pass DecodeConfig kwargs, one-pass kwargs)."""
    for b in LINEAR_BLOCKS:
        kw = dict(mode="linear", block_length=b)
        yield f"linear block {b}", profile.expected_tpf(b - 1), b, kw
    for n in PRESTO_BUDGETS:
        kw = dict(mode="presto", budget=n, block_length=PRESTO_BLOCK)
        yield f"presto budget {n}", profile.expected_tree_tau(n, PRESTO_BLOCK - 1), n + 1, kw


def projections(cost, profile, *, cache: int, synthetic: bool) -> list[dict]:
    """One record per layout (AR first): tau, the tree's width, f there, and tok/s for one forward
    of that width and for selfspec's two-pass and one-pass rounds (widths past the measured ones
    flagged `extrapolated`)."""
    from selfspec.engine.round.rounds import fixed_option
    from selfspec.engine.request.options import DecodeConfig

    f1, top = cost(1, 1, cache), max(cost.widths)
    tag = label(profile.name, synthetic)
    out = [{"layout": "ar", "tau": 1.0, "width": 1, "f_ms": 1e3 * f1, "tokens_per_second": 1 / f1,
            "two_pass_tokens_per_second": None, "one_pass_tokens_per_second": None, "one_pass_width": None,
            "extrapolated": False, "label": tag}]
    for name, tau, width, kw in _layouts(profile):
        f = cost(1, width, cache)
        rec = {"layout": name, "tau": tau, "width": width, "f_ms": 1e3 * f, "tokens_per_second": tau / f,
               "extrapolated": width > top, "label": tag}
        for schedule in ("two-pass", "one-pass"):
            cfg = DecodeConfig(schedule=schedule, **kw)
            opt = fixed_option(cfg)
            steps = cost.ar_steps(opt, block_length=cfg.block_length, cache=cache)
            rec[f"{schedule.replace('-', '_')}_tokens_per_second"] = tau / (steps * f1)
        rec["one_pass_width"] = fixed_option(DecodeConfig(schedule="one-pass", **kw)).width
        out.append(rec)
    return out


def record(model, cost, profile, *, cache: int, name: str, seconds: float) -> dict:
    from selfspec.checkpoint.synthetic import is_synthetic

    synthetic = is_synthetic(getattr(model, "selfspec_synthetic", None))
    f1, nbytes = cost(1, 1, cache), weight_bytes(model)
    return {"model": name, "synthetic": synthetic, "device": cost.device, "weights": cost.weights,
            "weight_bytes": nbytes, "cache": cache, "seconds": round(seconds, 1),
            "f_ms": {str(w): 1e3 * cost(1, w, cache) for w in cost.widths},
            "bytes_per_second_at_f1": nbytes / f1, "peak_memory_bytes": peak_memory_bytes(),
            "profile": profile.name, "label": label(profile.name, synthetic),
            "projections": projections(cost, profile, cache=cache, synthetic=synthetic)}


def _tps(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def text(rec: dict) -> str:
    """The record as a few lines and two Markdown tables."""
    f = rec["f_ms"]
    f1, top = f["1"], max(int(w) for w in f)
    peak = rec["peak_memory_bytes"]
    lines = [f"{rec['model']}{' (synthetic weights: seeded random, timing only)' if rec['synthetic'] else ''}, "
             f"{rec['weights']} on {rec['device']}: {rec['weight_bytes'] / 1e9:.3f} GB of weights read per forward "
             f"(weights' bytes / f(1): {rec['bytes_per_second_at_f1'] / 1e9:.1f} GB/s)",
             f"peak memory (VmHWM): {'unknown' if peak is None else f'{peak / 1e9:.2f} GB'}; measured in "
             f"{rec['seconds']} s", "",
             f"f(width), one forward over {rec['cache']} cached tokens:", "",
             "| width | " + " | ".join(f) + " |", "|---" * (len(f) + 1) + "|",
             "| f ms | " + " | ".join(f"{v:.2f}" for v in f.values()) + " |",
             "| f / f(1) | " + " | ".join(f"{v / f1:.2f}" for v in f.values()) + " |", "",
             f"{rec['label']}: tok/s = tau / f(the tree's width); beside it selfspec's two-pass and one-pass "
             f"rounds on the same curve (* = width past the measured ones, extrapolated); time outside the "
             f"forward not counted:", "",
             "| layout | tau | width | f ms | tok/s | two-pass tok/s | one-pass tok/s (width) |",
             "|---|---|---|---|---|---|---|"]
    for p in rec["projections"]:
        one = ("-" if p["one_pass_width"] is None else
               f"{_tps(p['one_pass_tokens_per_second'])} ({p['one_pass_width']}{'*' if p['one_pass_width'] > top else ''})")
        lines.append(f"| {p['layout']} | {p['tau']:.2f} | {p['width']}{'*' if p['extrapolated'] else ''} | "
                     f"{p['f_ms']:.2f} | {_tps(p['tokens_per_second'])} | {_tps(p['two_pass_tokens_per_second'])} | "
                     f"{one} |")
    return "\n".join(lines)
