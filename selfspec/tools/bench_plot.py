"""The bench's PNG plots (with the `plot` extra): tau and tokens/s against the PRESTO budget, and
the acceptance histograms."""

from __future__ import annotations

import os


def plot(rows: list[dict], out: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    if any(r["mode"] in ("presto", "linear") for r in rows):
        files.append(_budget_plot(plt, rows, out))
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


def _budget_plot(plt, rows: list[dict], out: str) -> str:
    """tau and tokens/s of PRESTO over its budget, linear and AR as lines (a run without them has no such plot)."""
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
    path = os.path.join(out, "tau_tps_vs_budget.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
