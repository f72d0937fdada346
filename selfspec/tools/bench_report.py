"""The bench's report: a row's figures from its per-prompt records, speedups per prompt kind, the
worst prompt against AR, the Markdown table and the floor lines (`bench.py` runs the rows)."""

from __future__ import annotations

from collections import Counter


def aggregate(records: list[dict]) -> dict:
    """One row's figures from its per-prompt records, through `Stats.total` (tau/TPF defined once)."""
    from selfspec.engine.stats import Stats

    keys = ("new_tokens", "rounds", "forwards", "round_tokens", "seconds", "forward_seconds", "tree_seconds")
    st = Stats.total([Stats(**{k: r.get(k, 0) for k in keys}, accept_lengths=r.get("accept_lengths", []),
                            oracle_lengths=r.get("oracle_lengths", []),
                            plan_hist=Counter(r.get("plan_hist", {}))) for r in records])
    sec = st.seconds
    return {
        "tau": st.tau if st.rounds else None,
        "tpf": st.tpf if st.forwards else None,
        "tokens_per_second": st.new_tokens / sec if sec else 0.0,
        "new_tokens": st.new_tokens,
        "seconds": sec,
        "forward_seconds": st.forward_seconds,
        "overhead_share": 1 - st.forward_seconds / sec if sec and st.forward_seconds else None,
        "tree_share": st.tree_seconds / sec if sec else 0.0,
        "oracle_tau": st.oracle_tau,
        "accept_hist": dict(sorted(Counter(st.accept_lengths).items())),
        # share of verification rounds whose first d drafted tokens were all accepted, d = 1..8
        "accept_by_depth": [sum(a > d for a in st.accept_lengths) / len(st.accept_lengths) for d in range(1, 9)]
        if st.accept_lengths else None,
        "plan_hist": dict(st.plan_hist.most_common()),
        "matches_ar": sum(r.get("matches_ar", True) for r in records),
        "prompts": len(records),
    }


def markdown_table(rows: list[dict]) -> str:
    head = ("| mode | schedule | budget | T | tau | accepted d1/d2/d3 | TPF | tok/s | vs AR | vs AR by kind | worst prompt | "
            "vs linear | overhead | tree build | oracle tau | = AR |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        same = f"{r['matches_ar']}/{r['prompts']}" if r["temperature"] == 0 else "sampled"
        kinds = " ".join(f"{k} {f(v['speedup_vs_ar'])}x" for k, v in r.get("by_kind", {}).items()) or "-"
        worst = r.get("worst_vs_ar")
        worst = f"{worst['id']} {f(worst['speedup_vs_ar'])}x" if worst else "-"
        lines.append(
            f"| {r['mode']} | {r['schedule'] or '-'} | {r['budget'] or '-'} | {r['temperature']:g} | {f(r['tau'])} | "
            f"{'/'.join(f(x) for x in (r.get('accept_by_depth') or [None] * 3)[:3])} | {f(r['tpf'])} | {f(r['tokens_per_second'], 1)} | {f(r['speedup_vs_ar'])}x | {kinds} | {worst} | {f(r['speedup_vs_linear'])}"
            f"{'x' if r['speedup_vs_linear'] is not None else ''} | {pct(r['overhead_share'])} | "
            f"{pct(r['tree_share'])} | {f(r['oracle_tau'])} | {same} |"
        )
    return "\n".join(lines)


def _worst(rows: list[dict]) -> None:
    """Each row's prompt with the lowest speedup vs AR (same temperature, same prompt): a floor
    that holds on average can still lose on one kind of text."""
    for r in rows:
        ar = next((x for x in rows if x["mode"] == "ar" and x["temperature"] == r["temperature"]), None)
        if ar is None or r is ar:
            continue
        ar_tps = {x["id"]: x["new_tokens"] / x["seconds"] for x in ar["records"] if x["seconds"] > 0}
        ratios = [(x["new_tokens"] / x["seconds"] / ar_tps[x["id"]], x["id"]) for x in r["records"]
                  if x["seconds"] > 0 and ar_tps.get(x["id"])]
        if ratios:
            v, pid = min(ratios)
            r["worst_vs_ar"] = {"id": pid, "speedup_vs_ar": v}


def floor_lines(rows: list[dict]) -> list[str]:
    """One line per temperature: plan auto against AR overall, per prompt kind and on its worst prompt."""
    out = []
    for r in rows:
        if r["mode"] != "auto" or r.get("speedup_vs_ar") is None:
            continue
        kinds = ", ".join(f"{k} {v['speedup_vs_ar']:.2f}x" for k, v in r.get("by_kind", {}).items()
                          if v.get("speedup_vs_ar") is not None)
        w = r.get("worst_vs_ar")
        out.append(f"auto / AR at T = {r['temperature']:g}: {r['speedup_vs_ar']:.2f}x" + (f" ({kinds})" if kinds else "")
                   + (f"; worst prompt {w['id']} {w['speedup_vs_ar']:.2f}x" if w else ""))
    return out


def _summed(runs: list[dict]) -> dict:
    """One prompt's record from its repeats: counts and times summed (the same tokens each time:
    greedy, or sampled with the same seed), the first run's ids and whether they all agreed."""
    out = dict(runs[0])
    for rec in runs[1:]:
        for k, v in rec.items():
            if k in ("id", "token_ids"):
                continue
            out[k] = ({**out[k], **{n: out[k].get(n, 0) + c for n, c in v.items()}} if isinstance(v, dict)
                      else out[k] + v)
    if len(runs) > 1:
        out["repeats"] = len(runs)
        out["repeats_agree"] = all(rec["token_ids"] == runs[0]["token_ids"] for rec in runs)
    return out


def prompt_kind(prompt_id: str) -> str:
    """"code03" -> "code": the default prompts are named by kind (code, chat) and number."""
    return str(prompt_id).rstrip("0123456789") or "prompt"


def _by_kind(rows: list[dict]) -> None:
    """Each row's tok/s and speedup vs AR (same temperature) per prompt kind, when the prompts
    have more than one kind: a mean over all prompts can hide that a layout pays on code only."""
    kinds = sorted({prompt_kind(x["id"]) for r in rows for x in r["records"]})
    if len(kinds) < 2:
        return
    for r in rows:
        r["by_kind"] = {k: {"tokens_per_second": aggregate([x for x in r["records"] if prompt_kind(x["id"]) == k])
                            ["tokens_per_second"]} for k in kinds}
    for r in rows:
        ar = next((x for x in rows if x["mode"] == "ar" and x["temperature"] == r["temperature"]), None)
        for k, v in r["by_kind"].items():
            base = ar["by_kind"][k]["tokens_per_second"] if ar else 0
            v["speedup_vs_ar"] = v["tokens_per_second"] / base if base else None
