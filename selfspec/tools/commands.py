"""The subcommands beside `generate`: `trace` (one HTML page of the draft trees) and `profile`
(this device's forward-cost curve; `--widths/--cache/--table`: a curve of one's own, printed;
`--project PROFILE`: the curve beside the weights' bytes and peak memory, and tok/s projected from
a replay profile's acceptance, `tools.projection`)."""

from __future__ import annotations

import json
import os
import sys
import time

from selfspec.tools.args import add_weights_args, decode_kwargs


def cmd_trace(a) -> int:
    from selfspec.loading import load
    from selfspec.engine.request.options import DecodeConfig
    from selfspec.streaming import generate

    if a.mode is None and a.plan is None:
        a.mode = "presto"
    DecodeConfig(**decode_kwargs(a))  # bad options fail before the model loads
    if a.open_rounds < 0 or a.max_trees < 0:
        raise ValueError("--open-rounds and --max-trees must be >= 0")
    out_dir = os.path.dirname(os.path.abspath(a.out))
    if not os.path.isdir(out_dir):
        raise ValueError(f"output folder {out_dir} does not exist")
    if a.prompt_file is not None:
        if not os.path.isfile(a.prompt_file):
            raise SystemExit(f"error: prompt file {a.prompt_file} not found")
        with open(a.prompt_file, encoding="utf-8") as f:
            prompt = f.read()
    else:
        prompt = a.prompt
    if not prompt:
        raise SystemExit("error: empty prompt")
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, device_map=a.device_map,
                      kv_cache_dtype=a.kv_cache_dtype)
    gen = generate(model, tok, prompt, seed=a.seed, stop=a.stop or None, trace=True, profile=a.profile,
                   **decode_kwargs(a))
    size = gen.trace.save(a.out, open_rounds=a.open_rounds, max_trees=a.max_trees)
    s = gen.stats.as_dict()
    print(f"{a.out}: {size / 1e6:.2f} MB, {s['rounds']} rounds, {s['new_tokens']} tokens, tau {s['tau']:.2f}",
          file=sys.stderr)
    return 0


def add_trace_parser(sub, add_common_args) -> None:
    t = sub.add_parser("trace", help="generate and write the per-round draft trees as one HTML page")
    src = t.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    t.add_argument("--stop", action="append", help="stop string (repeatable)")
    t.add_argument("--plan", default=None, choices=["auto", "fixed"],
                   help="auto: every round's layout chosen by the planner; fixed (default here): the flags' layout")
    t.add_argument("--mode", default=None, choices=["auto", "ar", "linear", "presto", "lookup"],
                   help="layout (default: presto, the trees this page is for; --plan auto picks per round)")
    t.add_argument("--schedule", default="one-pass", choices=["two-pass", "one-pass"])
    t.add_argument("--budget", type=int, default=32, help="PRESTO draft-node budget")
    t.add_argument("--out", default="trace.html", help="output HTML file (default trace.html)")
    t.add_argument("--open-rounds", type=int, default=8, help="rounds shown unfolded (default 8)")
    t.add_argument("--max-trees", type=int, default=128,
                   help="rounds drawn as trees; later rounds get one summary line each (default 128)")
    add_common_args(t)
    t.set_defaults(func=cmd_trace)


def cmd_profile(a) -> int:
    from selfspec.loading import load
    from selfspec.engine.measure.cost import ROWS, beside_others, default_path, measure

    if a.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.lora_cost:  # the draft LoRA's cost only: no cost model measured or written
        return _lora_cost(a)
    if a.project is not None:  # a curve of its own and projections: the cached cost model untouched
        return _project(a)
    custom = a.widths is not None or a.cache is not None
    if any(v < 1 for v in a.widths or []) or any(v < 0 for v in a.cache or []):
        raise ValueError("--widths take integers >= 1 and --cache integers >= 0")
    if custom and a.out is None:
        raise ValueError("--widths / --cache measure a curve of their own: name where it goes with --out "
                         "(the cached cost model keeps the planner's full grid)")
    model, _ = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, kv_cache_dtype=a.kv_cache_dtype)
    t0 = time.time()
    rows = tuple(r for r in ROWS if r < a.batch_size) + (next((r for r in ROWS if r >= a.batch_size), ROWS[-1]),)
    prof, others = beside_others(lambda: measure(model, rows=rows, widths=sorted(set(a.widths)) if a.widths else None,
                                                 cache=sorted(set(a.cache)) if a.cache else None))
    if others is not None:  # asked for: written, with the reason to measure again
        print(f"selfspec: other processes kept {others:.1f} of this machine's cores busy while measuring, which "
              f"skews the curve's shape: run it again when the machine is quiet", file=sys.stderr)
    path = a.out or default_path(model)
    prof.save(path)
    if a.table:  # the forward curve f(rows, width, cache), in ms and over f(1, 1, cache)
        print(curve_table(prof))
    c0 = prof.cache[0]
    f1 = prof(1, 1, c0)
    print(json.dumps({"path": path, "device": prof.device, "dtype": prof.dtype, "weights": prof.weights,
                      "seconds": round(time.time() - t0, 1), "f1_ms": round(1e3 * f1, 3),
                      "relative": {str(r): {str(w): round(prof(r, w, c0) / f1, 2) for w in prof.widths if r * w <= 256}
                                   for r in prof.rows}}))
    return 0


def _project(a) -> int:
    from selfspec.drafting.replay import load_profile
    from selfspec.engine.measure.cost import measure
    from selfspec.loading import load
    from selfspec.tools import projection

    profile = load_profile(a.project)  # a bad profile is one error, before the model is built
    widths = sorted(set(a.widths or projection.WIDTHS))
    cache = a.cache or [projection.CACHE]
    if widths[0] < 1 or len(cache) > 1 or cache[0] < 0 or a.sweeps < 1:
        raise ValueError("--project takes --widths >= 1, one --cache length >= 0 and --sweeps >= 1")
    t0 = time.time()
    model, _ = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, kv_cache_dtype=a.kv_cache_dtype)
    # every sweep runs, however slow (a big model's first sweep would exhaust the planner grid's time
    # budget): the fastest of several is what steadies a curve on a busy machine
    cost = measure(model, rows=(1,), widths=widths, cache=cache, sweeps=a.sweeps, budget_s=1e9)
    if a.out is not None:
        cost.save(a.out)
    name = a.model or getattr(model, "name_or_path", None) or "the default model"
    rec = projection.record(model, cost, profile, cache=cost.cache[0], name=name, seconds=time.time() - t0)
    print(projection.text(rec))
    print(json.dumps(rec))
    return 0


def _lora_cost(a) -> int:
    from selfspec.loading import load
    from selfspec.tools.profile_costs import lora_costs, lora_table

    widths = sorted(set(a.widths or (1, 5, 9, 17)))
    cache = (a.cache or [100])[0]
    if widths[0] < 1 or cache < 0 or len(a.cache or [100]) > 1 or a.repeats < 1:
        raise ValueError("--lora-cost takes --widths >= 1, one --cache length >= 0 and --repeats >= 1")
    model, _ = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, kv_cache_dtype=a.kv_cache_dtype,
                    progress=False)
    rows = lora_costs(model, widths, cache=cache, repeats=a.repeats)
    print(lora_table(rows))
    print(json.dumps({"lora_cost": rows}))
    return 0


def curve_table(prof) -> str:
    """One Markdown row per (cached tokens, rows): f(rows, width, cache) in ms and over f(1, 1, cache)."""
    lines = ["| cached | rows | " + " | ".join(f"w={w}" for w in prof.widths) + " |",
             "|---|---|" + "---|" * len(prof.widths)]
    for c in prof.cache:
        f1 = prof(1, 1, c)
        for r in prof.rows:
            cells = [f"{1e3 * prof(r, w, c):.2f} ms ({prof(r, w, c) / f1:.2f}x)" for w in prof.widths]
            lines.append(f"| {c} | {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def add_profile_parser(sub) -> None:
    p = sub.add_parser("profile", help="measure this device's forward-cost curve (used by --plan auto)")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default cpu)")
    add_weights_args(p)
    p.add_argument("--batch-size", type=int, default=1,
                   help="measure the rows axis up to this many rows (default 1: single prompts)")
    p.add_argument("--out", default=None, help="write here instead of the cache folder")
    p.add_argument("--widths", nargs="+", type=int, default=None,
                   help="round widths measured (default: the planner's grid; with --out only)")
    p.add_argument("--cache", nargs="+", type=int, default=None,
                   help="cached tokens per row measured (default: the planner's; with --out only)")
    p.add_argument("--table", action="store_true",
                   help="also print the forward curve f(rows, width, cache) as a Markdown table")
    p.add_argument("--lora-cost", action="store_true",
                   help="instead: what the draft LoRA adds to a probe round's forward per --widths (default 1 5 9 "
                        "17) over one --cache length (default 100); measures no cost model")
    p.add_argument("--repeats", type=int, default=15, help="--lora-cost: timed forwards per point (median; default 15)")
    p.add_argument("--project", default=None, metavar="PROFILE",
                   help="instead: f(width) (default widths 1-64, one --cache length, default 512) beside the weights' "
                        "bytes and peak memory, and AR / linear / PRESTO tok/s projected from a replay profile's "
                        "acceptance (a built-in such as nld-8b, or a JSON file); the cached cost model is not "
                        "touched (--out saves the curve)")
    p.add_argument("--sweeps", type=int, default=3,
                   help="--project: sweeps over the widths, each point's fastest kept (default 3)")
    p.set_defaults(func=cmd_profile)
