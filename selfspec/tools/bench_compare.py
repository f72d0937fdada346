"""`python -m selfspec bench compare A.json B.json`: an A/B as two runs of the same bench command
(two commits, or two public options), row by row.

Each row present in both files (same label and temperature) gets B's tok/s over A's. Each run's
noise comes from its own control row (`bench --control`: AR run twice as two rows, so its ratio
to AR shows what identical settings read in that run); a ratio within the larger of the two
runs' control spreads is marked as noise. Rows present in one file only are listed as such.
"""

from __future__ import annotations

import json

from selfspec.tools.bench_report import CONTROL


def load_rows(path: str) -> dict:
    """A results.json's rows by (label, temperature); one clear error for a file that is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"results file {path} not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON file ({e})") from None
    rows = res.get("rows") if isinstance(res, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "label" in r for r in rows):
        raise ValueError(f"{path} is not a bench results.json (no 'rows' list of labelled rows)")
    return {(r["label"], r.get("temperature")): r for r in rows}


def control_spreads(rows: dict) -> dict:
    """{(temperature, batch size): the control row's tok/s over its AR row's} for one run."""
    out = {}
    for r in rows.values():
        if r.get("mode") != CONTROL or not r.get("tokens_per_second"):
            continue
        key = (r.get("temperature"), r.get("batch_size"))
        ar = next((x for x in rows.values() if x.get("mode") == "ar"
                   and (x.get("temperature"), x.get("batch_size")) == key and x.get("tokens_per_second")), None)
        if ar:
            out[key] = r["tokens_per_second"] / ar["tokens_per_second"]
    return out


METRICS = ("tokens_per_second", "tau", "tpf")


def compare(a: dict, b: dict, metric: str = "tokens_per_second") -> dict:
    """Rows in both (ratio B/A of `metric`, and whether it exceeds the runs' control spread, a
    spread of tok/s), and rows in one only."""
    timed = metric == "tokens_per_second"
    spread_a, spread_b = (control_spreads(a), control_spreads(b)) if timed else ({}, {})
    both = []
    for key in [k for k in a if k in b]:
        ra, rb = a[key], b[key]
        tps_a, tps_b = ra.get(metric), rb.get(metric)
        ratio = tps_b / tps_a if tps_a and tps_b is not None else None
        skey = (key[1], ra.get("batch_size"))
        spreads = [abs(s - 1) for s in (spread_a.get(skey), spread_b.get(skey)) if s is not None]
        noise = max(spreads) if spreads else None
        both.append({"label": key[0], "temperature": key[1], "a": tps_a, "b": tps_b, "ratio": ratio,
                     "control_a": spread_a.get(skey), "control_b": spread_b.get(skey), "spread": noise,
                     "beyond_spread": None if noise is None or ratio is None else abs(ratio - 1) > noise})
    only = [{"label": k[0], "temperature": k[1], "only_in": "A"} for k in a if k not in b]
    only += [{"label": k[0], "temperature": k[1], "only_in": "B"} for k in b if k not in a]
    return {"metric": metric, "rows": both, "only": only}


def table(res: dict, name_a: str, name_b: str) -> str:
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    unit = {"tokens_per_second": "tok/s"}.get(res["metric"], res["metric"])
    lines = [f"A = {name_a}", f"B = {name_b}", "",
             f"| row | T | A {unit} | B {unit} | B/A | control/AR in A | control/AR in B | beyond the control spread |",
             "|---|---|---|---|---|---|---|---|"]
    none = "- (no --control row)" if res["metric"] == "tokens_per_second" else "- (a spread of tok/s only)"
    for r in res["rows"]:
        beyond = {None: none, True: "yes", False: f"no (within {100 * (r['spread'] or 0):.1f}%)"}
        lines.append(f"| {r['label']} | {r['temperature'] if r['temperature'] is not None else '-'} | {f(r['a'], 1)} | "
                     f"{f(r['b'], 1)} | {f(r['ratio'])}x | {f(r['control_a'])} | {f(r['control_b'])} | "
                     f"{beyond[r['beyond_spread']]} |")
    for r in res["only"]:
        lines.append(f"| {r['label']} | {r['temperature'] if r['temperature'] is not None else '-'} | "
                     f"only in {r['only_in']} |  |  |  |  |  |")
    return "\n".join(lines)


def cmd_compare(a) -> int:
    rows_a, rows_b = load_rows(a.a), load_rows(a.b)  # both read before anything is printed
    res = compare(rows_a, rows_b, a.metric)
    print(table(res, a.a, a.b))
    if a.json:
        print(json.dumps(res))
    return 0


def add_compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="each row's tok/s ratio between two results.json, with the control spread")
    c.add_argument("a", help="results.json of run A (the baseline)")
    c.add_argument("b", help="results.json of run B")
    c.add_argument("--metric", default="tokens_per_second", choices=METRICS,
                   help="the figure compared (default tokens_per_second; tau or tpf: what the drafts gave)")
    c.add_argument("--json", action="store_true", help="also print the comparison as one JSON line")
    c.set_defaults(func=cmd_compare)


def cmd_plot(a) -> int:
    """The PNG plots of a decode-grid results.json, written again (results pages keep no plots)."""
    import os

    from selfspec.tools.bench_common import check_out
    from selfspec.tools.bench_plot import plot

    load_rows(a.results)  # its checks first: one clear error for a file that is not a results.json
    with open(a.results, encoding="utf-8") as f:
        rows = json.load(f)["rows"]
    if not all("accept_hist" in r for r in rows):
        raise ValueError(f"{a.results} is not a decode-grid results.json (its rows have no acceptance histograms)")
    for r in rows:  # JSON made the histograms' keys strings; the plots count rounds by int length
        r["accept_hist"] = {int(k): v for k, v in r["accept_hist"].items()}
    out = check_out(a.out or os.path.dirname(os.path.abspath(a.results)))
    files = plot(rows, out)
    if not files:
        raise ValueError("plots need matplotlib (pip install -e '.[plot]')")
    print("\n".join(files))
    return 0


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="write the plots of a bench results.json again")
    p.add_argument("results", help="a results.json of the decode grid (python -m selfspec bench)")
    p.add_argument("--out", default=None, help="output folder (default: the results file's folder)")
    p.set_defaults(func=cmd_plot)
