"""How fast could prompt-lookup speculation be on these prompts? A hindsight bound.

    python benchmarks/lookup_bound.py                          # the default model's bench prompts, 64 tokens
    python benchmarks/lookup_bound.py --suite long             # the long-context suite (~1k and ~3k tokens), 96
    python benchmarks/lookup_bound.py --curve issue-38         # as if wide forwards cost what issue 38 asks
    python benchmarks/lookup_bound.py --prompts my.jsonl --model DIR --weights int8   # your prompts, model, format

For each prompt: the greedy AR output (the tokens every mode must emit), then a replay of it with
perfect hindsight. At each decode round's position the runtime's lookup index (prompt + output so
far, n-grams 1..3, `drafting/lookup.py`) proposes its chain of up to `--chain` tokens, and we know
how many of them the verifier would accept (the chain's leading tokens that equal the output). A
planner that knew every acceptance in advance picks, round by round, AR (one token for f(1)) or a
lookup round of k <= chain tokens (min(accepted, k) + 1 tokens for f(k + 1)); dynamic programming
over the positions finds its least total time. f(w) is one forward of w tokens timed here at the
prompt's context (`--curve forward`, the median of `--repeats` calls; `--curve model`: the planner's
cost model instead) plus what a round costs besides its forward (AR's measured decode time less its
forwards' time, per round: the bound's fewer rounds save that too). The bound is that planner's
speed over AR's: no lookup planner on this model, machine and prompts decodes faster, short of
timing noise (the forwards are timed in a loop, warmer than inside a decode). It leaves out
mask-group drafts (PRESTO trees, linear chains), which need the model's marginals at each position;
on this CPU `auto` picks them about once a generation (a probe), so its measured speed (`python -m
selfspec bench`, the same prompts) is to be read against this bound.

Prints one line per prompt, one per group (kind, or length with split or task for the long suite:
the AR time over the bound's time, both summed over the group's prompts) and a JSON record with
the command.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def best_time(chains: list[tuple[int, int]], f, cached: list[int]) -> tuple[float, list[int]]:
    """Least decode time of n = len(chains) output positions (chains[i]: (chain length, accepted) at
    position i, cached[i] its cached tokens) and the tokens each chosen round emits, in order.
    f(width, cached) is one forward's seconds. A round at i of k drafted tokens (k = 0: AR) costs
    f(k + 1, cached[i]) and moves to i + min(accepted, k) + 1; rounds past n are cut at n (the
    generation stops there).

    >>> f = lambda w, c: 1.0 + 0.25 * (w - 1)
    >>> best_time([(3, 3), (0, 0), (0, 0), (0, 0), (0, 0)], f, [0] * 5)
    (2.75, [4, 1])
    """
    n = len(chains)
    best, step = [0.0] * (n + 1), [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        length, acc = chains[i][:2]
        best[i], step[i] = f(1, cached[i]) + best[i + 1], 1
        for k in range(1, length + 1):
            j = min(n, i + min(acc, k) + 1)
            t = f(k + 1, cached[i]) + best[j]
            if t < best[i]:
                best[i], step[i] = t, j - i
    rounds, i = [], 0
    while i < n:
        rounds.append(step[i])
        i += step[i]
    return best[0], rounds


def acceptance_table(chains: list[tuple[int, int, int]]) -> dict[int, list[float]]:
    """{match length: P(chain token j accepted | tokens before it were)} over the given positions,
    for j below the match's longest chain (0.0 where none got that far): counted as `auto`'s lookup
    calibration counts (`PositionCalibrator`, here without fading or prior, and keyed by the match
    length alone where `auto` also keys by the row's run of whole chains).

    >>> acceptance_table([(2, 2, 3), (2, 0, 3), (1, 0, 1)])
    {3: [0.5, 1.0], 1: [0.0]}
    """
    from selfspec.engine.calibration import PositionCalibrator

    cal, longest = PositionCalibrator(positions=max((c[0] for c in chains), default=1), forget=1.0), {}
    for length, acc, match in chains:
        cal.update(length, acc, match)
        longest[match] = max(longest.get(match, 0), length)
    return {m: [t / r if r else 0.0 for r, t in zip(reached[: longest[m]], taken[: longest[m]])]
            for m, (reached, taken) in cal.counts.items()}


def calibrated_time(chains: list[tuple[int, int, int]], f, cached: list[int], table: dict[int, list[float]]):
    """Decode time of a planner that knows `table` (`acceptance_table`), not the outcomes: each round
    verifies the k <= chain tokens of the most expected tokens per second (k = 0: AR), then moves
    by what the output really accepts. Returns (seconds, rounds).

    >>> f = lambda w, c: 1.0 + 0.25 * (w - 1)
    >>> calibrated_time([(3, 3, 3), (0, 0, 0), (0, 0, 0), (0, 0, 0), (0, 0, 0)], f, [0] * 5, {3: [0.9, 0.9, 0.9]})
    (2.75, 2)
    """
    n, i, total, rounds = len(chains), 0, 0.0, 0
    while i < n:
        length, acc, match = chains[i]
        p, run, expect, best_k, best_rate = table.get(match, []), 1.0, 1.0, 0, 1.0 / f(1, cached[i])
        for k in range(1, min(length, len(p)) + 1):
            run *= p[k - 1]
            expect += run
            if expect / f(k + 1, cached[i]) > best_rate:
                best_k, best_rate = k, expect / f(k + 1, cached[i])
        total += f(best_k + 1, cached[i])
        i += min(acc, best_k) + 1
        rounds += 1
    return total, rounds


def target_ratio(width: int) -> float:
    """f(width) / f(1) of issue 38's kernel target: 1.25 at 8 rows, 1.6 at 16, linear between and
    beyond (the points it names).

    >>> [target_ratio(w) for w in (1, 8, 12, 16)]
    [1.0, 1.25, 1.425, 1.6]
    """
    if width <= 8:
        return 1.0 + 0.25 * (width - 1) / 7
    return 1.25 + 0.35 * (width - 8) / 8


def replay(prompt: list[int], out: list[int], chain: int, min_ngram: int = 1, max_ngram: int = 3):
    """(chain length, accepted, n-gram match length) for each decode round's first position i = 1 ..
    len(out) - 1 (the prefill emits out[0]): the runtime's lookup chain from prompt + out[:i] (out[i - 1]
    is the round's root), against out[i:].

    >>> replay([5, 6, 7, 8, 5, 6], [7, 8, 9], chain=4)
    [(4, 1, 3), (4, 0, 3)]
    """
    from selfspec.drafting.lookup import ContextIndex
    from selfspec.engine.shadow import follow  # the runtime's own count of a chain's tokens a row bore out

    index = ContextIndex(prompt + out[:1], min_ngram=min_ngram, max_ngram=max_ngram)
    rows = []
    for i in range(1, len(out)):
        if i > 1:
            index.extend(out[i - 1 : i])
        ctx = prompt + out[:i]
        c = index.propose(ctx[-max_ngram:], chain)
        rows.append((len(c), follow(c, 0, out[i:])[0], index.match_length(ctx[-max_ngram:])))
    return rows


def forward_curve(model, context: list[int], widths: range, repeats: int) -> dict[int, float]:
    """{width: seconds} of one row's forward + output head of `width` new tokens (a causal block, as a
    lookup chain's verification) after `context` is cached: the median of `repeats` calls, after one."""
    from forward_curve import cached_row, time_forward  # beside this file

    bf, cache = cached_row(model, context, max(widths) + 8)
    out = {}
    for w in widths:
        toks, pos = context[-w:], range(len(context), len(context) + w)
        times = sorted([time_forward(bf, cache, toks, list(pos)) for _ in range(repeats + 1)][1:])  # after one
        out[w] = times[len(times) // 2]
    return out


def main() -> None:
    from selfspec.tools.args import add_weights_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", choices=["default", "long"], default="default",
                    help="default: the model's bench prompts (prompts.jsonl); long: the shipped long-context suite")
    ap.add_argument("--prompts", default=None,
                    help='a JSONL file of {"prompt": ...} or {"messages": [...]} per line instead (as `selfspec bench`)')
    ap.add_argument("--model", default=None, help="checkpoint directory or registered name (default: the shipped model)")
    add_weights_args(ap)
    ap.add_argument("--new", type=int, default=None, help="new tokens per prompt (default 64; 96 with --suite long)")
    ap.add_argument("--chain", type=int, default=10, help="longest lookup chain (the runtime's lookup_tokens: 10)")
    ap.add_argument("--limit", type=int, default=0, help="first N prompts (of each length with --suite long)")
    ap.add_argument("--curve", choices=["forward", "model", "issue-38"], default="forward",
                    help="forward: forwards timed here at each prompt's context; model: the planner's cost model "
                         "(`python -m selfspec profile`: measured at 64 and 1,024 cached tokens, extrapolated beyond); "
                         "issue-38: the timed f(1), wider forwards costing what issue 38 asks of a kernel (f(8) = "
                         "1.25 f(1), f(16) = 1.6 f(1), linear between)")
    ap.add_argument("--repeats", type=int, default=7, help="timed calls per width (--curve forward / issue-38)")
    a = ap.parse_args()
    for name in ("new", "chain", "repeats"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name} must be at least 1")
    if a.limit < 0:
        ap.error("--limit must be 0 (all) or more")
    new = a.new or (96 if a.suite == "long" else 64)

    import selfspec
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.engine.cost import cost_model
    from selfspec.engine.decoder import Decoder
    from selfspec.engine.options import DecodeConfig
    from selfspec.streaming import encode_prompt
    from selfspec.tools.bench_prompts import read_prompts, read_suite

    if a.prompts is not None and a.suite == "long":
        raise SystemExit("error: --prompts and --suite long are two prompt sets; give one")
    if a.prompts is not None:  # read before the model loads: a bad file fails first
        try:
            prompts = read_prompts(a.prompts)
        except (OSError, ValueError) as e:
            raise SystemExit(f"error: {e}") from None
    elif a.suite == "long":
        prompts = read_suite("long", a.limit)
    else:
        path = os.path.join(a.model or default_model_dir(), "prompts.jsonl")
        if not os.path.isfile(path):
            raise SystemExit(f"error: {path} not found: give the prompts with --prompts FILE")
        prompts = read_prompts(path)
    if a.suite != "long":
        prompts = prompts[: a.limit] if a.limit else prompts
    model, tok = selfspec.load(a.model, weights=a.weights, dtype=a.dtype, kv_cache_dtype=a.kv_cache_dtype,
                               progress=False)
    cost = cost_model(model) if a.curve == "model" else None
    no_eos = {"eos_token_id": []} if a.suite == "long" else {}  # the long suite decodes every token, as the bench

    def greedy(ids):
        """AR's output and its decode seconds (after the prefill's token, as the bench times it)."""
        dec = Decoder(model, [ids], DecodeConfig(mode="ar", max_new_tokens=new), **no_eos)
        first = None
        for _ in dec:
            first = first or time.perf_counter()
        return list(dec.outputs[0]), time.perf_counter() - first

    rows, kept = [], []
    for p in prompts:
        ids = encode_prompt(tok, p["prompt"])
        greedy(ids)  # warm
        out, seconds = greedy(ids)
        chains = replay(ids, out, a.chain)
        cached = [len(ids) + i - 1 for i in range(1, len(out))]  # the root is not cached yet
        if a.curve == "model":
            fwd = lambda w, c, cost=cost: cost(1, w, c)  # noqa: E731
        else:  # timed at the middle of the decode's contexts
            curve = forward_curve(model, ids + out[: len(out) // 2], range(1, a.chain + 2), a.repeats)
            if a.curve == "issue-38":
                curve = {w: curve[1] * target_ratio(w) for w in curve}
            fwd = lambda w, c, curve=curve: curve[w]  # noqa: E731
        # what a round costs besides its forward (sampling, commit, Python), from AR's measured decode:
        # the same for every round here, so the bound's fewer rounds save it too
        extra = max(0.0, seconds - sum(fwd(1, c) for c in cached)) / max(1, len(chains))
        f = lambda w, c, fwd=fwd, extra=extra: fwd(w, c) + extra  # noqa: E731 (bound now: kept for later)
        t_ar = sum(f(1, c) for c in cached)
        t_best, rounds = best_time(chains, f, cached)
        kept.append((p, chains, f, cached))
        rec = {"id": p["id"], **{k: p[k] for k in ("split", "task", "length") if k in p}, "prompt_tokens": len(ids),
               "new_tokens": len(out), "bound": round(t_ar / t_best, 3), "bound_tau": round(len(chains) / max(1, len(rounds)), 2),
               "positions_with_an_accepted_chain": sum(1 for c in chains if c[1] > 0),
               "ar_seconds": round(t_ar, 5), "bound_seconds": round(t_best, 5), "measured_ar_seconds": round(seconds, 5),
               "round_extra_ms": round(extra * 1e3, 3),
               "f_ms": {w: round(fwd(w, cached[0]) * 1e3, 2) for w in (1, 2, 4, 8) if w <= a.chain + 1}}
        rows.append(rec)
        print(" ".join(f"{k} {v}" for k, v in rec.items() if k not in ("ar_seconds", "bound_seconds")), flush=True)
    # a planner calibrated on these very prompts (each length of the long suite apart): still optimistic
    tables = {}
    for p, chains, _, _ in kept:
        tables.setdefault(p.get("length", "all"), []).extend(chains)
    tables = {k: acceptance_table(v) for k, v in tables.items()}
    for r, (p, chains, f, cached) in zip(rows, kept):
        t, n = calibrated_time(chains, f, cached, tables[p.get("length", "all")])
        r["calibrated"], r["calibrated_seconds"] = round(r["ar_seconds"] / t, 3), t
    groups = {}
    for r in rows:
        if "length" in r:  # the long suite: by length and split, by length and task
            keys = {f"{r['length']} {r['split']}", f"{r['length']} {r['task']}", r["length"], "all"}
        elif a.prompts is None:  # the model's bench prompts: code00, chat03, ...
            keys = {r["id"].rstrip("0123456789"), "all"}
        else:
            keys = {"all"}
        for key in keys:
            g = groups.setdefault(key, [0.0, 0.0, 0.0, 0])
            g[0], g[1], g[2], g[3] = g[0] + r["ar_seconds"], g[1] + r["bound_seconds"], g[2] + r["calibrated_seconds"], g[3] + 1
    for name, (ar, best, cal, n) in sorted(groups.items()):
        print(f"{name}: {n} prompts, bound {ar / best:.3f}x AR, calibrated planner {ar / cal:.3f}x")
    for r in rows:
        del r["calibrated_seconds"]
    print(json.dumps({"command": "python benchmarks/lookup_bound.py " + " ".join(sys.argv[1:]), "chain": a.chain,
                      "new_tokens": new, "curve": a.curve, "cost_model": cost.source if cost else None, "rows": rows,
                      "tables": {k: {m: [round(x, 3) for x in v] for m, v in t.items()} for k, t in tables.items()},
                      "groups": {k: {"bound": round(v[0] / v[1], 3), "calibrated": round(v[0] / v[2], 3)}
                                 for k, v in groups.items()}}))


if __name__ == "__main__":
    main()
