"""The GPU check's report (benchmarks/gpu_check.sh): python benchmarks/gpu_check_report.py OUT_DIR

Reads OUT_DIR/bench_<w>/results.json and OUT_DIR/profile_<w>.json; per weight format and row:
greedy output equal to AR's token for token (and where not, the first diverging position per
prompt), tau, tokens per forward, tok/s, and for every row whether its two runs per prompt
(--repeats 2) gave the same tokens; at T > 0 also how many prompts' samples equal AR's sample with
the same seed (reproducible sampling). Writes OUT_DIR/summary.json and OUT_DIR/summary.md.
"""

from __future__ import annotations

import glob
import json
import os
import sys


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where the two token lists differ (a length difference counts), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def report(out: str) -> dict:
    summary = {"formats": {}}
    for path in sorted(glob.glob(os.path.join(out, "bench_*", "results.json"))):
        w = os.path.basename(os.path.dirname(path)).removeprefix("bench_")
        res = json.load(open(path))
        rows = []
        for r in res["rows"]:
            t = r["temperature"]
            ar = next((x for x in res["rows"] if x["mode"] == "ar" and x["temperature"] == t), None)
            ar_ids = {x["id"]: x["token_ids"] for x in ar["records"]} if ar else {}
            div = []
            for x in r["records"]:
                d = first_divergence(x["token_ids"], ar_ids[x["id"]]) if x["id"] in ar_ids else None
                if d is not None:
                    div.append({"prompt": x["id"], "position": d, "tokens": len(x["token_ids"]),
                                "ar_tokens": len(ar_ids[x["id"]]), "token": x["token_ids"][d:d + 1],
                                "ar_token": ar_ids[x["id"]][d:d + 1]})
            rows.append({"label": r["label"], "mode": r["mode"], "schedule": r["schedule"], "temperature": t,
                         "prompts": r["prompts"], "equal_to_ar": r["prompts"] - len(div), "divergences": div,
                         "repeats_agree": sum(x.get("repeats_agree", True) for x in r["records"]),
                         "tau": r["tau"], "tpf": r["tpf"], "tokens_per_second": r["tokens_per_second"],
                         "speedup_vs_ar": r["speedup_vs_ar"], "new_tokens": r["new_tokens"],
                         "plan_hist": r.get("plan_hist")})
        summary["formats"][w] = {"dtype": res["dtype"], "device": res["device"], "versions": res["versions"],
                                 "command": res["command"], "n_prompts": res["n_prompts"],
                                 "wall_seconds": res["wall_seconds"], "rows": rows}
    for path in sorted(glob.glob(os.path.join(out, "profile_*.json"))):
        w = os.path.basename(path).removeprefix("profile_").removesuffix(".json")
        p = json.load(open(path))
        curves = {}
        for ci, c in enumerate(p["cache"]):
            line = p["seconds"][ci][0]  # rows = 1
            curves[str(c)] = {"f1_ms": round(1e3 * line[0], 4),
                              "relative": {str(wd): round(s / line[0], 3) for wd, s in zip(p["widths"], line)}}
        summary.setdefault("profiles", {})[w] = {"device": p["device"], "dtype": p["dtype"], "cache": curves}
    return summary


def markdown(summary: dict) -> str:
    f = lambda v, n=2: "-" if v is None else f"{v:.{n}f}"  # noqa: E731
    lines = []
    for w, s in summary["formats"].items():
        lines += [f"### {w} ({s['dtype']}, {s['device']}, {s['n_prompts']} prompts)", "",
                  "| row | T | = AR | first divergence | runs agree | tau | TPF | tok/s | vs AR |", "|" + "---|" * 9]
        for r in s["rows"]:
            # a peer's samples come from its own generator: only its greedy output is compared
            peer = r["mode"] not in ("ar", "auto", "lookup", "linear", "presto", "hybrid")
            same = "-" if r["mode"] == "ar" or (peer and r["temperature"] > 0) else f"{r['equal_to_ar']}/{r['prompts']}"
            div = "-" if same == "-" else "; ".join(f"{d['prompt']} @{d['position']}" for d in r["divergences"]) or "-"
            lines.append(f"| {r['label']} | {r['temperature']:g} | {same} | {div} | {r['repeats_agree']}/{r['prompts']} | "
                         f"{f(r['tau'])} | {f(r['tpf'])} | {f(r['tokens_per_second'], 1)} | {f(r['speedup_vs_ar'])}x |")
        lines.append("")
    for w, p in summary.get("profiles", {}).items():
        lines.append(f"### cost model {w} ({p['device']}, {p['dtype']}), rows = 1: f(width) / f(1)")
        for c, curve in p["cache"].items():
            rel = " ".join(f"{k}:{v:.2f}" for k, v in curve["relative"].items())
            lines.append(f"- cache {c}: f(1) = {curve['f1_ms']:.3f} ms; {rel}")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    out = sys.argv[1]
    s = report(out)
    with open(os.path.join(out, "summary.json"), "w") as fh:
        json.dump(s, fh, indent=1)
    md = markdown(s)
    with open(os.path.join(out, "summary.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
