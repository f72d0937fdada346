"""Combine bench runs into one Markdown table: python benchmarks/summarize.py runs/sweep/*/results.json"""

import json
import sys


def main(paths):
    print("| run | mode | schedule | B | budget | rho / lambda | tau | TPF | oracle tau | tok/s | tree build | overhead | = AR |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        res = json.load(open(p))
        run = p.split("/")[-2]
        for r in res["rows"]:
            c = r["config"]
            rho = f"{c['rho']} / {c['lam']}" if r["mode"] == "presto" else "-"
            orc = "-" if r["oracle_tau"] is None else f"{r['oracle_tau']:.2f}"
            print(f"| {run} | {r['mode']} | {r['schedule'] or '-'} | {c['block_length']} | {r['budget'] or '-'} | {rho} | "
                  f"{r['tau']:.2f} | {r['tpf']:.2f} | {orc} | {r['tokens_per_second']:.1f} | "
                  f"{100 * r.get('tree_share', 0):.1f}% | {100 * r['overhead_share']:.1f}% | {r['matches_ar']}/{r['prompts']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
