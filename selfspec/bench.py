"""`python -m selfspec bench`: AR vs linear vs PRESTO on the same prompts, model and machine.

Every configuration runs on every prompt after a warm-up; greedy by default, in which case each
output is also checked token for token against AR. Prints a Markdown table, writes
results.json (settings, versions, per-prompt records) and, with matplotlib installed, PNG plots;
the last stdout line is one JSON summary.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import replace

from .config import MODES, SCHEDULES, DecodeConfig


def read_prompts(path: str) -> list[dict]:
    """JSONL with {"prompt": str} or {"messages": [...]} per line; every bad line is reported."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path} not found")
    rows, errors = [], []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append(f"line {no}: not JSON ({e.msg})")
                continue
            if not isinstance(rec, dict):
                errors.append(f"line {no}: expected an object")
            elif isinstance(rec.get("prompt"), str) and rec["prompt"]:
                rows.append({"id": rec.get("id", f"line{no}"), "prompt": rec["prompt"]})
            elif isinstance(rec.get("messages"), list) and rec["messages"]:
                rows.append({"id": rec.get("id", f"line{no}"), "prompt": rec["messages"]})
            else:
                errors.append(f"line {no}: needs a non-empty 'prompt' string or 'messages' list")
    if errors:
        raise ValueError(f"{path}: " + "; ".join(errors[:10]) + (f" (+{len(errors) - 10} more)" if len(errors) > 10 else ""))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def grid(modes, schedules, budgets, base: dict) -> list[DecodeConfig]:
    out = []
    if "ar" in modes:
        out.append(DecodeConfig(**{**base, "mode": "ar", "schedule": "two-pass"}))
    for s in schedules:
        if "linear" in modes:
            out.append(DecodeConfig(**{**base, "mode": "linear", "schedule": s}))
        if "presto" in modes:
            out.extend(DecodeConfig(**{**base, "mode": "presto", "schedule": s, "budget": b}) for b in budgets)
    return out


def label(c: DecodeConfig) -> str:
    if c.mode == "ar":
        return "ar"
    return f"{c.mode}/{c.schedule}" + (f"/N={c.budget}" if c.mode == "presto" else "")


def aggregate(records: list[dict]) -> dict:
    rt = sum(r["round_tokens"] for r in records)
    rounds = sum(r["rounds"] for r in records)
    fwd = sum(r["forwards"] for r in records)
    new = sum(r["new_tokens"] for r in records)
    sec = sum(r["seconds"] for r in records)
    fsec = sum(r["forward_seconds"] for r in records)
    tsec = sum(r["tree_seconds"] for r in records)
    orc = [o for r in records for o in r["oracle_lengths"]]
    hist: dict[int, int] = {}
    for r in records:
        for a in r["accept_lengths"]:
            hist[a] = hist.get(a, 0) + 1
    return {
        "tau": rt / rounds if rounds else 0.0,
        "tpf": rt / fwd if fwd else 0.0,
        "tokens_per_second": new / sec if sec else 0.0,
        "new_tokens": new,
        "seconds": sec,
        "forward_seconds": fsec,
        "overhead_share": 1 - fsec / sec if sec else 0.0,
        "tree_share": tsec / sec if sec else 0.0,
        "oracle_tau": sum(orc) / len(orc) if orc else None,
        "accept_hist": dict(sorted(hist.items())),
        "matches_ar": sum(r.get("matches_ar", True) for r in records),
        "prompts": len(records),
    }


def markdown_table(rows: list[dict]) -> str:
    head = "| mode | schedule | budget | tau | TPF | tok/s | vs AR | vs linear | overhead | tree build | oracle tau | = AR |"
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        lines.append(
            f"| {r['mode']} | {r['schedule'] or '-'} | {r['budget'] or '-'} | {f(r['tau'])} | {f(r['tpf'])} | "
            f"{f(r['tokens_per_second'], 1)} | {f(r['speedup_vs_ar'])}x | {f(r['speedup_vs_linear'])}"
            f"{'x' if r['speedup_vs_linear'] is not None else ''} | {100 * r['overhead_share']:.1f}% | "
            f"{100 * r['tree_share']:.1f}% | "
            f"{f(r['oracle_tau'])} | {r['matches_ar']}/{r['prompts']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], out: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for s in sorted({r["schedule"] for r in rows if r["schedule"]}):
        pr = sorted((r for r in rows if r["mode"] == "presto" and r["schedule"] == s), key=lambda r: r["budget"])
        lin = [r for r in rows if r["mode"] == "linear" and r["schedule"] == s]
        for ax, key in zip(axes, ("tau", "tokens_per_second")):
            if pr:
                ax.plot([r["budget"] for r in pr], [r[key] for r in pr], "o-", label=f"presto {s}")
            if lin:
                ax.axhline(lin[0][key], ls="--", color="gray" if s == "two-pass" else "black", label=f"linear {s}")
    ar = [r for r in rows if r["mode"] == "ar"]
    if ar:
        axes[1].axhline(ar[0]["tokens_per_second"], ls=":", color="red", label="ar")
    for ax, name in zip(axes, ("tau (tokens / round)", "tokens / s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("PRESTO node budget")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.append(os.path.join(out, "tau_tps_vs_budget.png"))
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    spec = [r for r in rows if r["mode"] != "ar"]
    if spec:
        fig, ax = plt.subplots(figsize=(10, 4))
        width = 0.8 / len(spec)
        for i, r in enumerate(spec):
            h = r["accept_hist"]
            total = sum(h.values()) or 1
            xs = sorted(int(k) for k in h)
            ax.bar([x + i * width for x in xs], [h[k] / total for k in xs], width, label=r["label"])
        ax.set_xlabel("tokens committed per round")
        ax.set_ylabel("share of rounds")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        files.append(os.path.join(out, "acceptance_hist.png"))
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    return files


def run_bench(model, tokenizer, prompts: list[dict], configs: list[DecodeConfig], *, seed: int = 0,
              warmup_tokens: int = 8, progress: bool = True) -> list[dict]:
    """Run every config on every prompt; returns one row per config with per-prompt records."""
    import torch
    from tqdm import tqdm

    from .runtime import Decoder
    from .streaming import encode_prompt

    encoded = [encode_prompt(tokenizer, p["prompt"]) for p in prompts]
    for c in configs:  # warm-up: first prompt, a few tokens, every config
        for _ in Decoder(model, encoded[0], replace(c, max_new_tokens=warmup_tokens)):
            pass
    rows, ar_out = [], {}
    bar = tqdm(total=len(configs) * len(prompts), desc="bench", file=sys.stderr, disable=not progress)
    for c in configs:
        records = []
        for p, ids in zip(prompts, encoded):
            gen = torch.Generator(device=model.get_input_embeddings().weight.device).manual_seed(seed)
            dec = Decoder(model, ids, c, generator=gen)
            out = [t for chunk in dec for t in chunk]
            st = dec.stats
            rec = {"id": p["id"], "token_ids": out, **{k: getattr(st, k) for k in (
                "new_tokens", "rounds", "forwards", "round_tokens", "seconds", "forward_seconds", "tree_seconds",
                "accept_lengths", "oracle_lengths")}}
            if c.mode == "ar":
                ar_out[p["id"]] = out
            elif c.temperature == 0 and p["id"] in ar_out:
                rec["matches_ar"] = out == ar_out[p["id"]]
            records.append(rec)
            bar.update(1)
        rows.append({"label": label(c), "mode": c.mode, "schedule": None if c.mode == "ar" else c.schedule,
                     "budget": c.budget if c.mode == "presto" else None, "config": c.__dict__,
                     **aggregate(records), "records": records})
    bar.close()
    ar_tps = next((r["tokens_per_second"] for r in rows if r["mode"] == "ar"), None)
    for r in rows:
        lin = next((x["tokens_per_second"] for x in rows if x["mode"] == "linear" and x["schedule"] == r["schedule"]), None)
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar_tps if ar_tps else None
        r["speedup_vs_linear"] = r["tokens_per_second"] / lin if lin and r["mode"] == "presto" else None
    return rows


def cmd_bench(a) -> int:
    import torch
    import transformers

    from .model import default_model_dir, load

    for m in a.modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; expected some of {MODES}")
    for s in a.schedules:
        if s not in SCHEDULES:
            raise ValueError(f"unknown schedule {s!r}; expected some of {SCHEDULES}")
    model_dir = a.model or default_model_dir()
    prompts_path = a.prompts or os.path.join(model_dir, "prompts.jsonl")
    prompts = read_prompts(prompts_path)
    prompts = prompts[: a.limit] if a.limit else prompts
    base = dict(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, block_length=a.block_length,
                group_size=a.group_size, group_nodes=a.group_nodes, tree_top_k=a.tree_top_k, lam=a.lam, rho=a.rho,
                draft_lora=not a.no_draft_lora)
    configs = grid(a.modes, a.schedules, a.budgets, base)
    out = a.out or os.path.join("bench_out", time.strftime("%Y%m%d-%H%M%S"))
    try:
        os.makedirs(out, exist_ok=True)
        probe = os.path.join(out, ".write_test")
        with open(probe, "w") as f:
            f.write("")
        os.remove(probe)
    except OSError as e:
        raise ValueError(f"output folder {out} cannot be written: {e}") from None
    model, tok = load(a.model, dtype=a.dtype, device=a.device, device_map=a.device_map)
    t0 = time.time()
    rows = run_bench(model, tok, prompts, configs, seed=a.seed)
    table = markdown_table(rows)
    print(table)
    pngs = plot(rows, out)
    result = {
        "command": "python -m selfspec " + " ".join(a.argv),
        "settings": {k: v for k, v in vars(a).items() if k not in ("func", "argv")},
        "model": os.path.abspath(model_dir), "dtype": str(model.dtype), "device": str(model.device),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "prompts_file": os.path.abspath(prompts_path), "n_prompts": len(prompts), "wall_seconds": round(time.time() - t0, 1),
        "rows": rows, "plots": pngs,
    }
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table + "\n")
    summary = {"out": out, "n_prompts": len(prompts), "wall_seconds": result["wall_seconds"],
               "rows": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                         if k in ("label", "tau", "tpf", "tokens_per_second", "speedup_vs_ar", "speedup_vs_linear",
                                  "oracle_tau", "matches_ar", "overhead_share", "tree_share")} for r in rows]}
    print(json.dumps(summary))
    return 0


def add_bench_parser(sub, add_common_args) -> None:
    b = sub.add_parser("bench", help="compare AR, linear and PRESTO on a prompt file")
    add_common_args(b)
    b.add_argument("--prompts", default=None, help="JSONL prompt file (default: the model's prompts.jsonl)")
    b.add_argument("--modes", nargs="+", default=["ar", "linear", "presto"])
    b.add_argument("--schedules", nargs="+", default=["two-pass", "one-pass"])
    b.add_argument("--budgets", nargs="+", type=int, default=[8, 32])
    b.add_argument("--limit", type=int, default=32,
                   help="use the first N prompts (default 32: the default grid then runs in ~2.5 min on 2 CPU cores; 0 = all)")
    b.add_argument("--out", default=None, help="output folder (default bench_out/<time>)")
    b.set_defaults(func=cmd_bench, max_new_tokens=64)
