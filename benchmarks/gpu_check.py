"""The GPU check: what NLD-3B- and NLD-8B-shaped models would run at on one lent GPU, in <= 8 minutes.

    python benchmarks/gpu_check.py --out DIR             # on the GPU machine (bf16, cuda)
    python benchmarks/gpu_check.py --dry-run --out DIR   # CPU, synthetic:tiny: all but the CUDA-only parts
    python benchmarks/gpu_check.py --project COST.json   # projections from a saved cost model (`selfspec profile`)

Models are synthetic (`selfspec.load("synthetic:nld-8b")`: the published shapes, seeded random
weights, timing only) and every speculative row replays a real NLD-8B's published draft acceptance
(`replay="nld-8b"`, selfspec.drafting.replay): every number is labelled so. Per model:
  1. the device's memory bandwidth (a big device-to-device copy) and the weights' bytes / bandwidth:
     the floor of one forward;
  2. f(width) for widths 1-64 at a 512-token cache (`engine.cost.measure`, what the planner reads);
  3. CUDA graphs: the same forward captured per width bucket and replayed (what launching its kernels
     costs shows as eager minus graph); a forward that cannot be captured records why;
  4. AR, replayed linear (one-pass, block 32) and replayed PRESTO (one-pass, budget 32): tok/s, tau,
     and the share of time outside the forward (`Stats.overhead_share`); greedy output equal to AR's;
  5. the issue's targets (NLD-8B: f(1) <= 1.3x its bandwidth floor, f(32) / f(1) <= 1.3, time
     outside the forward <= 10%, replayed PRESTO >= 3x AR) checked, and projections from f(width)
     and published acceptance.
Writes DIR/gpu_check.json and DIR/gpu_check.md. Steps that would run past --time-limit are skipped
and say so. Installs nothing (run from the checkout: `PYTHONPATH=. python benchmarks/gpu_check.py`).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRY_WIDTHS = (1, 2, 4, 8, 32)  # the dry run's (a test runs it: under a minute on a shared CPU)
GRAPH_WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # the width buckets a decoder would capture
CACHE = 512
PROFILE = "nld-8b"
# published NLD-8B tokens per round (../shared spec nld-acceptance.md): linear with its LoRA at
# blocks 8 / 16 / 32 (tokens per forward, a fused two-row forward counted once), PRESTO one-pass budget 32
PUBLISHED_TAU = {("linear", 8): 3.21, ("linear", 16): 4.75, ("linear", 32): 5.96, ("presto", 32): 5.6}
PROMPT = ("def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
          "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n")
LABEL = "synthetic weights (seeded random, timing only)"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", default=None, help="output folder (default bench_out/gpu-check-<time>)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, synthetic:tiny, short runs: all but the CUDA-only parts")
    ap.add_argument("--models", nargs="+", default=None, help="synthetic shapes (default nld-3b nld-8b; dry run: tiny)")
    ap.add_argument("--device", default=None, help="default cuda (dry run: cpu)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="tokens per generation row (default 128; dry run 12)")
    ap.add_argument("--replay", default=PROFILE, help=f"replay profile of the speculative rows (default {PROFILE})")
    ap.add_argument("--time-limit", type=float, default=450.0, help="seconds; later steps are skipped (default 450)")
    ap.add_argument("--project", default=None, metavar="COST.json",
                    help="only print projections from a saved cost model (`selfspec profile --out`) and exit")
    a = ap.parse_args(argv)
    a.models = a.models or (["tiny"] if a.dry_run else ["nld-3b", "nld-8b"])
    a.device = a.device or ("cpu" if a.dry_run else "cuda")
    a.max_new_tokens = a.max_new_tokens or (8 if a.dry_run else 128)
    a.out = a.out or os.path.join("bench_out", time.strftime("gpu-check-%Y%m%d-%H%M%S"))
    return a


# -- measurements ----------------------------------------------------------------------------------
def bandwidth(device: str, dry_run: bool) -> dict:
    """Bytes per second of a big device copy (read + write counted), the best of several."""
    import torch

    n = (64 << 20) if dry_run else (2 << 30)
    src = torch.empty(n // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3 if dry_run else 20):
        dst.copy_(src)
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return {"bytes_copied": n, "seconds": best, "bytes_per_second": 2 * n / best}


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def cost_curve(model, dry_run: bool):
    from selfspec.engine.measure.cost import measure

    return measure(model, rows=(1,), widths=widths(dry_run), cache=(CACHE,), sweeps=1 if dry_run else 3,
                   budget_s=5.0 if dry_run else 20.0, progress=False)


def widths(dry_run: bool) -> tuple[int, ...]:
    return DRY_WIDTHS if dry_run else WIDTHS


def graph_curve(model, device: str) -> dict:
    """Per width bucket: the forward of `cost_curve`'s points captured in a CUDA graph and replayed
    (milliseconds), or why it could not be captured. CUDA only."""
    import torch

    from selfspec.engine.forward.batch_forward import BatchForward

    bf = BatchForward.of(model)
    kv = bf.new_cache(1, CACHE + max(GRAPH_WIDTHS) + 1)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    bf(torch.randint(0, V, (1, CACHE), generator=g), torch.arange(CACHE)[None], kv, slice(0, 1), causal=True)
    out = {}
    for w in GRAPH_WIDTHS:
        # inputs on the device already: a host-to-device copy cannot be captured
        toks = torch.randint(0, V, (1, w), generator=g).to(device)
        pos = torch.arange(w, device=device)[None]
        block = torch.full((w, w), float("-inf"), device=device, dtype=model.dtype).triu_(1)[None]

        def fwd():
            kv.set_length(0, CACHE)
            return bf.logits(bf(toks, pos, kv, slice(0, 1), block=block)[:, : min(w, 48)].reshape(-1, model.config.hidden_size))
        try:
            out[str(w)] = {"graph_ms": 1e3 * _graph_seconds(fwd, device)}
        except Exception as e:  # noqa: BLE001 -- the reason is the result
            out[str(w)] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
    return out


def _graph_seconds(fwd, device: str, reps: int = 20) -> float:
    import torch

    s = torch.cuda.Stream(device)
    s.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(3):  # warm-up off the default stream, as capture requires
            fwd()
    torch.cuda.current_stream(device).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        fwd()
    graph.replay()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / reps


def has_replay() -> bool:
    import selfspec

    return "replay" in inspect.signature(selfspec.stream).parameters


def generation_rows(model, tok, a) -> list[dict]:
    """AR, linear and PRESTO (one-pass) on one prompt, the speculative rows replaying `a.replay`;
    each after an untimed warm-up of its own layout. Greedy: every row must equal AR's tokens."""
    import selfspec

    replay = {"replay": a.replay} if has_replay() else {}
    n = 8 if a.dry_run else 32  # the dry run's layouts are narrower (same code, less CPU)
    rows = [("ar", {"mode": "ar"}), (f"linear one-pass, block {n}", {"mode": "linear", "schedule": "one-pass", "block_length": n}),
            (f"presto one-pass, budget {n}", {"mode": "presto", "schedule": "one-pass", "budget": n, "block_length": n})]
    out, ref = [], None
    for label, kw in rows:
        extra = replay if kw["mode"] != "ar" else {}
        for n in ((a.max_new_tokens,) if a.dry_run else (4, a.max_new_tokens)):  # untimed warm-up of the layout
            gen = selfspec.generate(model, tok, PROMPT, max_new_tokens=n, eos_token_id=[], **kw, **extra)
        s = gen.stats.as_dict()
        ref = gen.token_ids if ref is None else ref
        drafts = (f"replayed acceptance (profile {a.replay})" if extra else
                  "AR" if kw["mode"] == "ar" else "random drafts (no replay in this checkout)")
        out.append({"row": label, "drafts": drafts, "tokens_per_second": s["tokens_per_second"], "tau": s["tau"],
                    "tpf": s["tpf"], "new_tokens": s["new_tokens"], "seconds": s["seconds"],
                    "forward_seconds": s["forward_seconds"], "overhead_share": s["overhead_share"],
                    "equal_to_ar": gen.token_ids == ref})
    ar = out[0]["tokens_per_second"]
    for r in out:
        r["speedup_vs_ar"] = round(r["tokens_per_second"] / ar, 3) if ar else None
    return out


def projections(cost, cache: int = CACHE) -> list[dict]:
    """tok/s a layout would reach from the cost model alone: published tau / f(the round's width),
    time outside the forward not counted (an upper bound for the engine)."""
    from selfspec.engine.round.rounds import fixed_option
    from selfspec.engine.request.options import DecodeConfig

    f1 = cost(1, 1, cache)
    out = [{"layout": "ar", "tau": 1.0, "width": 1, "extrapolated": False, "ar_steps": 1.0,
            "tokens_per_second": round(1 / f1, 2)}]
    for ((mode, n), tau), schedule in ((x, s) for x in PUBLISHED_TAU.items() for s in ("two-pass", "one-pass")):
        cfg = DecodeConfig(mode=mode, schedule=schedule, **({"block_length": n} if mode == "linear" else
                                                             {"budget": n, "block_length": 32}))
        opt = fixed_option(cfg)
        steps = cost.ar_steps(opt, block_length=cfg.block_length, cache=cache)
        out.append({"layout": f"{mode} {schedule} {'block' if mode == 'linear' else 'budget'} {n}", "tau": tau,
                    "width": opt.width, "extrapolated": opt.width > max(cost.widths), "ar_steps": round(steps, 3),
                    "tokens_per_second": round(tau / steps / f1, 2)})
    return out


# -- one model -------------------------------------------------------------------------------------
def check_model(name: str, a, bw: dict, deadline: float) -> dict:
    import torch

    import selfspec
    from selfspec.checkpoint.synthetic import weight_bytes

    rec = {"model": f"synthetic:{name}", "label": LABEL, "weights": "bf16", "skipped": []}
    t0 = time.perf_counter()
    model, tok = selfspec.load(f"synthetic:{name}", weights="bf16", device=a.device, progress=False)
    rec["step_seconds"] = {"build": round(time.perf_counter() - t0, 1)}
    rec["weight_bytes"] = weight_bytes(f"synthetic:{name}")
    floor = rec["weight_bytes"] / bw["bytes_per_second"]
    cost = cost_curve(model, a.dry_run)
    f1 = cost(1, 1, CACHE)
    rec["cost"] = {"cache": CACHE, "bandwidth_floor_ms": round(1e3 * floor, 4),
                   "f_ms": {str(w): round(1e3 * cost(1, w, CACHE), 4) for w in widths(a.dry_run)},
                   "f1_over_floor": round(f1 / floor, 3), "f32_over_f1": round(cost(1, 32, CACHE) / f1, 3)}
    rec["projections"] = projections(cost)
    rec["step_seconds"]["cost"] = round(time.perf_counter() - t0 - sum(rec["step_seconds"].values()), 1)
    if a.device.startswith("cuda") and time.perf_counter() < deadline:
        rec["graphs"] = graph_curve(model, a.device)
        rec["step_seconds"]["graphs"] = round(time.perf_counter() - t0 - sum(rec["step_seconds"].values()), 1)
    else:
        rec["graphs"] = None
        rec["skipped"].append("CUDA graphs: CUDA only" if not a.device.startswith("cuda") else "CUDA graphs: time limit")
    if time.perf_counter() < deadline:
        rec["rows"] = generation_rows(model, tok, a)
        rec["step_seconds"]["rows"] = round(time.perf_counter() - t0 - sum(rec["step_seconds"].values()), 1)
        worst = max(r["overhead_share"] for r in rec["rows"])
        rec["graphs_needed"] = worst > 0.10  # the rule: capture where time outside the forward > 10%
    else:
        rec["rows"] = None
        rec["skipped"].append("generation rows: time limit")
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def targets(rec: dict, dry_run: bool) -> dict:
    """The issue's GPU targets for one model (None where not measured: all of them in a dry run)."""
    if dry_run:
        return dict.fromkeys(("f1_within_1.3x_floor", "f32_over_f1_within_1.3", "outside_forward_within_10pct",
                              "replayed_presto_3x_ar"))
    rows = {r["row"].split()[0]: r for r in rec.get("rows") or []}
    presto = rows.get("presto")
    replayed = presto is not None and presto["drafts"].startswith("replayed")
    return {"f1_within_1.3x_floor": rec["cost"]["f1_over_floor"] <= 1.3,
            "f32_over_f1_within_1.3": rec["cost"]["f32_over_f1"] <= 1.3,
            "outside_forward_within_10pct": None if not rows else max(r["overhead_share"] for r in rows.values()) <= 0.10,
            "replayed_presto_3x_ar": None if not replayed else presto["speedup_vs_ar"] >= 3.0}


def environment(a) -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "device": a.device, "dry_run": a.dry_run}
    if a.device.startswith("cuda"):
        p = torch.cuda.get_device_properties(a.device)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), cuda=torch.version.cuda)
    return env


def markdown(res: dict) -> str:
    lines = [f"# GPU check ({res['environment'].get('gpu', res['environment']['device'])}"
             f"{', DRY RUN on CPU: no GPU figure here' if res['environment']['dry_run'] else ''})", "",
             f"{LABEL}; speculative rows: {res['drafts']}. Bandwidth (device copy): "
             f"{res['bandwidth']['bytes_per_second'] / 1e9:.1f} GB/s.", ""]
    for rec in res["models"]:
        c = rec["cost"]
        lines += [f"## {rec['model']} (bf16, {rec['weight_bytes'] / 2**20:,.1f} MiB of weights read per forward)", "",
                  f"Bandwidth floor {c['bandwidth_floor_ms']:.3f} ms; f(1) = {c['f1_over_floor']:.2f}x floor; "
                  f"f(32) / f(1) = {c['f32_over_f1']:.2f}.", "",
                  "| width | " + " | ".join(c["f_ms"]) + " |", "|---" * (len(c["f_ms"]) + 1) + "|",
                  "| f ms | " + " | ".join(f"{v:.3f}" for v in c["f_ms"].values()) + " |"]
        if rec["graphs"]:
            lines.append("| graph ms | " + " | ".join(
                f"{rec['graphs'][w]['graph_ms']:.3f}" if "graph_ms" in rec["graphs"].get(w, {}) else "-"
                for w in c["f_ms"]) + " |")
            errors = {g["error"] for g in rec["graphs"].values() if "error" in g}
            lines += [f"\nCUDA graph capture failed: {e}" for e in errors]
        lines += ["", "| row | drafts | tok/s | tau | TPF | outside forward | vs AR | = AR |", "|---" * 8 + "|"]
        for r in rec["rows"] or []:
            lines.append(f"| {r['row']} | {r['drafts']} | {r['tokens_per_second']:.1f} | {r['tau']:.2f} | {r['tpf']:.2f} | "
                         f"{100 * r['overhead_share']:.0f}% | {r['speedup_vs_ar']:.2f}x | {'yes' if r['equal_to_ar'] else 'NO'} |")
        lines += ["", "Projected from f(width) and published NLD-8B tau (time outside the forward not counted): " +
                  "; ".join(f"{p['layout']} (width {p['width']}{', f extrapolated' if p['extrapolated'] else ''}) "
                            f"{p['tokens_per_second']:.1f} tok/s" for p in rec["projections"]),
                  "", "Targets: " + ", ".join(f"{k} {v}" for k, v in rec["targets"].items()),
                  *(["", "Skipped: " + "; ".join(rec["skipped"])] if rec["skipped"] else []), ""]
    return "\n".join(lines)


def project_only(path: str) -> int:
    from selfspec.engine.measure.cost import CostModel

    cost = CostModel.load(path)
    cache = min(cost.cache, key=lambda c: abs(c - CACHE))
    f1 = cost(1, 1, cache)
    print(json.dumps({"cost_model": path, "device": cost.device, "weights": cost.weights, "cache": cache,
                      "f_ms": {str(w): round(1e3 * cost(1, w, cache), 2) for w in WIDTHS},
                      "relative": {str(w): round(cost(1, w, cache) / f1, 2) for w in WIDTHS},
                      "projections": projections(cost, cache)}, indent=1))
    return 0


def main(argv=None) -> int:
    a = parse(argv)
    if a.project:
        return project_only(a.project)
    import torch

    if a.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("error: no CUDA device here; --dry-run runs the CPU parts")
    os.makedirs(a.out, exist_ok=True)
    start = time.perf_counter()
    deadline = start + a.time_limit
    bw = bandwidth(a.device, a.dry_run)
    res = {"environment": environment(a), "label": LABEL, "bandwidth": bw, "models": [],
           "drafts": f"replayed acceptance (profile {a.replay})" if has_replay() else
           "random drafts (this checkout has no replay)"}
    for name in a.models:
        if time.perf_counter() > deadline:
            res.setdefault("skipped", []).append(f"synthetic:{name}: time limit")
            continue
        rec = check_model(name, a, bw, deadline)
        rec["targets"] = targets(rec, a.dry_run)
        res["models"].append(rec)
        print(f"gpu_check: synthetic:{name} done in {rec['seconds']} s", file=sys.stderr)
    res["seconds"] = round(time.perf_counter() - start, 1)
    with open(os.path.join(a.out, "gpu_check.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(a.out, "gpu_check.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
