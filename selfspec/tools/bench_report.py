"""The bench's report: a row's figures from its per-prompt records, speedups per prompt kind, the
worst prompt against AR, the Markdown table and the floor lines (`bench.py` runs the rows); for the
long-context suite, the same per length and split with time to first token and decode tok/s."""

from __future__ import annotations

from collections import Counter


def aggregate(records: list[dict]) -> dict:
    """One row's figures from its per-prompt records, through `Stats.total` (tau/TPF defined once).
    A peer's failed prompts (a "failed" record) are left out of every figure and counted."""
    from selfspec.engine.request.stats import Stats

    failed = sum("failed" in r for r in records)
    records = [r for r in records if "failed" not in r]

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
        "failed": failed,
    }


def markdown_table(rows: list[dict]) -> str:
    head = ("| mode | schedule | budget | T | tau | accepted d1/d2/d3 | TPF | tok/s | vs AR | vs AR by kind | worst prompt | "
            "vs linear | overhead | tree build | oracle tau | = AR |")
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
        pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        same = (f"{r['matches_ar']}/{r['prompts']}" if r["temperature"] == 0 else "sampled") + _failed(r)
        kinds = " ".join(f"{k} {f(v['speedup_vs_ar'])}x" for k, v in r.get("by_kind", {}).items()) or "-"
        worst = r.get("worst_vs_ar")
        worst = f"{worst['id']} {f(worst['speedup_vs_ar'])}x" if worst else "-"
        if not r["prompts"]:  # a peer that failed on every prompt: no figures
            lines.append(f"| {r['mode']} | - | - | {r['temperature']:g} |" + " - |" * 11 + f"{same} |")
            continue
        lines.append(
            f"| {r['mode']} | {r['schedule'] or '-'} | {r['budget'] or '-'} | {r['temperature']:g} | {f(r['tau'])} | "
            f"{'/'.join(f(x) for x in (r.get('accept_by_depth') or [None] * 3)[:3])} | {f(r['tpf'])} | {f(r['tokens_per_second'], 1)} | {f(r['speedup_vs_ar'])}x | {kinds} | {worst} | {f(r['speedup_vs_linear'])}"
            f"{'x' if r['speedup_vs_linear'] is not None else ''} | {pct(r['overhead_share'])} | "
            f"{pct(r['tree_share'])} | {f(r['oracle_tau'])} | {same} |"
        )
    return "\n".join(lines)


def _failed(row: dict) -> str:
    return f" ({row['failed']} failed)" if row.get("failed") else ""


def _worst(rows: list[dict]) -> None:
    """Each row's prompt with the lowest speedup vs AR (same temperature, same prompt): a floor
    that holds on average can still lose on one kind of text. With it, how many of that prompt's
    rounds ran AR, and the row's speedup per repeat (`repeat_speedups`)."""
    for r in rows:
        ar = next((x for x in rows if x["mode"] == "ar" and x["temperature"] == r["temperature"]), None)
        if ar is None or r is ar:
            continue
        ar_tps = {x["id"]: x["new_tokens"] / x["seconds"] for x in ar["records"] if x["seconds"] > 0}
        ratios = [(x["new_tokens"] / x["seconds"] / ar_tps[x["id"]], x["id"]) for x in r["records"]
                  if x["seconds"] > 0 and ar_tps.get(x["id"])]
        if ratios:
            v, pid = min(ratios)
            rec = next(x for x in r["records"] if x["id"] == pid)
            r["worst_vs_ar"] = {"id": pid, "speedup_vs_ar": v}
            if rec.get("rounds") and rec.get("plan_hist"):  # a loss with every round AR is no bet lost
                r["worst_vs_ar"].update(ar_rounds=rec["plan_hist"].get("ar", 0), rounds=rec["rounds"])
        r["speedup_vs_ar_repeats"] = repeat_speedups(r["records"], ar["records"])


CONTROL = "ar (control)"  # the AR row run a second time (`bench --control`): what the run's noise alone does


def floor_lines(rows: list[dict]) -> list[str]:
    """One line per temperature: plan auto against AR overall, per prompt kind and on its worst
    prompt; after it, with `--control`, the second AR row against the first in the same terms (an
    identical setting's ratio: how far this run's noise moves one)."""
    return [line for _, line in _floor_rows(rows)]


def _floor_rows(rows: list[dict]) -> list[tuple[dict, str]]:
    """(row, its floor line) for auto's rows, each followed by the control row of its temperature;
    control rows without an auto row after those."""
    controls = {c["temperature"]: c for c in rows if c["mode"] == CONTROL and c.get("speedup_vs_ar") is not None}
    lines = []
    for r in rows:
        if r["mode"] == "auto" and r.get("speedup_vs_ar") is not None:
            lines.append((r, _floor_line("auto / AR", r)))
            if (c := controls.pop(r["temperature"], None)) is not None:
                lines.append((c, _floor_line("control AR / AR", c)))
    return lines + [(c, _floor_line("control AR / AR", c)) for c in controls.values()]


def _floor_line(name: str, r: dict) -> str:
    kinds = ", ".join(f"{k} {v['speedup_vs_ar']:.2f}x" for k, v in r.get("by_kind", {}).items()
                      if v.get("speedup_vs_ar") is not None)
    reps = r.get("speedup_vs_ar_repeats")
    spread = f", per repeat {min(reps):.2f}-{max(reps):.2f}x" if reps else ""
    worst = r.get("worst_vs_ar")
    if worst and r["mode"] == CONTROL:  # every round of either row is AR: no rounds to name
        worst = {k: v for k, v in worst.items() if k not in ("ar_rounds", "rounds")}
    return (f"{name} at T = {r['temperature']:g}: {r['speedup_vs_ar']:.2f}x{spread}" + (f" ({kinds})" if kinds else "")
            + _worst_text(worst))


def _worst_text(w: dict | None) -> str:
    """The "; worst prompt ..." note: the worst prompt's ratio to AR, its split where the row has
    splits, and how many of its rounds auto ran AR."""
    if not w:
        return ""
    notes = ([w["split"]] if w.get("split") else []) + (
        [f"AR in {w['ar_rounds']} of {w['rounds']} rounds"] if w.get("rounds") else [])
    return f"; worst prompt {w['id']} {w['speedup_vs_ar']:.2f}x" + (f" ({'; '.join(notes)})" if notes else "")


def _summed(runs: list[dict]) -> dict:
    """One prompt's record from its repeats: counts and times summed (the same tokens each time:
    greedy, or sampled with the same seed), the first run's ids and whether they all agreed."""
    bad = next((rec for rec in runs if "failed" in rec), None)
    if bad is not None:  # a peer that failed on any repeat has no figures for this prompt
        return bad
    out = dict(runs[0])
    for rec in runs[1:]:
        for k, v in rec.items():
            if k in ("id", "token_ids") or isinstance(v, str):  # ids and the prompt's fields (split, ...)
                continue
            out[k] = ({**out[k], **{n: out[k].get(n, 0) + c for n, c in v.items()}} if isinstance(v, dict)
                      else out[k] + v)
    if len(runs) > 1:
        out["repeats"] = len(runs)
        out["repeats_agree"] = all(rec["token_ids"] == runs[0]["token_ids"] for rec in runs)
        # each repeat's own, in run order: a row's speedup per repeat (`repeat_speedups`)
        out["repeat_new_tokens"] = [rec.get("new_tokens", 0) for rec in runs]
        out["repeat_seconds"] = [rec.get("seconds", 0.0) for rec in runs]
    return out


def repeat_speedups(records: list[dict], ar_records: list[dict]) -> list[float] | None:
    """A row's tok/s over AR's, once per repeat: repeat k of every prompt the two rows share, summed
    (the mirrored order runs a prompt's rows side by side, so repeat k of one and of the other ran
    close in time). Their spread is what the machine's drift does to one run's ratio; None without
    repeats.

    Example: prompts a and b, two repeats each; AR 10 tokens in 1.0 / 1.0 s on a, 1.0 / 1.2 s on b;
    auto 1.0 / 0.8 s on a, 1.2 / 1.0 s on b -> repeat 1: (20 / 2.2) / (20 / 2.0) = 0.91, repeat 2:
    (20 / 1.8) / (20 / 2.2) = 1.22."""
    ar = {x["id"]: x for x in ar_records if "repeat_seconds" in x}
    pairs = [(x, ar[x["id"]]) for x in records if "repeat_seconds" in x and x["id"] in ar]
    if not pairs or len({len(y["repeat_seconds"]) for pair in pairs for y in pair}) != 1:
        return None

    def tokens_per_second(recs, k):
        sec = sum(x["repeat_seconds"][k] for x in recs)
        return sum(x["repeat_new_tokens"][k] for x in recs) / sec if sec > 0 else 0.0

    mine, theirs = [x for x, _ in pairs], [a for _, a in pairs]
    out = [(tokens_per_second(mine, k), tokens_per_second(theirs, k)) for k in range(len(mine[0]["repeat_seconds"]))]
    return [m / a for m, a in out] if all(m > 0 and a > 0 for m, a in out) else None


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


def decode_figures(records: list[dict]) -> dict:
    """Time to first token (mean per run, s) and decode tok/s (tokens after the first / time after
    the first) of a row's records; None where the records have no such timing (hf peers)."""
    timed = [x for x in records if x.get("ttft_seconds") is not None]
    runs = sum(x.get("repeats", 1) for x in timed)
    dsec = sum(x["decode_seconds"] for x in timed)
    return {"ttft_seconds": sum(x["ttft_seconds"] for x in timed) / runs if runs else None,
            "decode_tokens_per_second": sum(x["decode_tokens"] for x in timed) / dsec if timed and dsec > 0 else None}


def _subrows(rows: list[dict], keep) -> list[dict]:
    """The rows re-aggregated over the records `keep` accepts (speedups against AR recomputed)."""
    out = []
    for r in rows:
        recs = [x for x in r["records"] if keep(x)]
        if recs:
            out.append({**{k: r[k] for k in ("label", "mode", "temperature")}, "records": recs, **aggregate(recs),
                        **decode_figures(recs)})
    for r in out:
        ar = next((x for x in out if x["mode"] == "ar" and x["temperature"] == r["temperature"]), None)
        r["speedup_vs_ar"] = r["tokens_per_second"] / ar["tokens_per_second"] if ar and ar["tokens_per_second"] else None
        d, ad = r["decode_tokens_per_second"], ar and ar["decode_tokens_per_second"]
        r["decode_vs_ar"] = d / ad if d is not None and ad else None
    return out


def _groups(rows: list[dict]) -> list[tuple[str, str]]:
    """The (length, split) pairs of the records, in suite order (1k before 3k, tune before held-out)."""
    seen = {(x.get("length", "-"), x.get("split", "-")) for r in rows for x in r["records"]}
    order = {"tune": 0, "held-out": 1}
    return sorted(seen, key=lambda g: (int(g[0].rstrip("k")) if g[0].rstrip("k").isdigit() else 0, order.get(g[1], 2)))


def long_report(rows: list[dict]) -> list[dict]:
    """Per (length, split) and row: prompts, time to first token, decode tok/s and its ratio to AR's,
    end-to-end tok/s and its ratio, greedy equality with AR (results.json's "suite")."""
    out = []
    for length, split in _groups(rows):
        for r in _subrows(rows, lambda x: (x.get("length", "-"), x.get("split", "-")) == (length, split)):
            out.append({"length": length, "split": split, "label": r["label"], "mode": r["mode"],
                        "temperature": r["temperature"], "prompts": r["prompts"], "ttft_seconds": r["ttft_seconds"],
                        "decode_tokens_per_second": r["decode_tokens_per_second"], "decode_vs_ar": r["decode_vs_ar"],
                        "tokens_per_second": r["tokens_per_second"], "speedup_vs_ar": r["speedup_vs_ar"],
                        "matches_ar": r["matches_ar"], "plan_hist": r["plan_hist"], "failed": r["failed"]})
    return out


def long_table(rows: list[dict]) -> str:
    """The long suite's Markdown table: one line per length, split and row."""
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["| length | split | row | T | prompts | first token s | decode tok/s | decode vs AR | tok/s | vs AR | = AR |",
             "|" + "---|" * 11]
    for g in long_report(rows):
        same = (f"{g['matches_ar']}/{g['prompts']}" if g["temperature"] == 0 else "sampled") + _failed(g)
        if not g["prompts"]:
            lines.append(f"| {g['length']} | {g['split']} | {g['label']} | {g['temperature']:g} | 0 |" + " - |" * 5 +
                         f" {same} |")
            continue
        lines.append(f"| {g['length']} | {g['split']} | {g['label']} | {g['temperature']:g} | {g['prompts']} | "
                     f"{f(g['ttft_seconds'])} | {f(g['decode_tokens_per_second'], 1)} | {f(g['decode_vs_ar'])}x | "
                     f"{f(g['tokens_per_second'], 1)} | {f(g['speedup_vs_ar'])}x | {same} |")
    return "\n".join(lines)


def long_floor_lines(rows: list[dict]) -> list[str]:
    """`floor_lines` for each length (both splits; per task, and the worst prompt), with auto's
    decode tok/s against AR's and the split the worst prompt is in."""
    out = []
    for length in dict.fromkeys(g[0] for g in _groups(rows)):
        sub = _subrows(rows, lambda x: x.get("length", "-") == length)
        _by_kind(sub)
        _worst(sub)
        for r in sub:
            w = r.get("worst_vs_ar")
            if w and r["mode"] in ("auto", CONTROL):
                w["split"] = next((x.get("split") for x in r["records"] if x["id"] == w["id"]), None)
        for r, line in _floor_rows(sub):
            out.append(f"~{length} tokens: {line}"
                       + (f"; decode {r['decode_vs_ar']:.2f}x" if r.get("decode_vs_ar") is not None else ""))
    return out
