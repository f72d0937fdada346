"""The replay hindsight bound: what a planner that knew every round's outcome would pay.

Under acceptance replay a draft's fate at depth d from a root is a fixed function of (prompt,
output position, depth) (`drafting.replay.Replay.outcome`), whatever the layout; so for each
place a round can start, what each candidate layout would commit is known. The bound is the
least total cost, in the cost model's AR steps, of emitting a generation's tokens with one
candidate layout per round (a shortest path over (tokens emitted, marginals at hand)), and its
speedup over AR the tokens over that cost. Candidates: AR; a probe (AR plus a mask group: buys
marginals); for each budget (1, 2, 4, ... cfg.budget), the linear chain and the best rank tree
of that many nodes, block_length - 1 deep at most (what a group's marginals reach) (the paths over the top-2 candidates with the most replayed probability), in
one pass with a group of block_length on every node (needs marginals, leaves them), verified
alone (needs them, leaves none) and two-pass (needs none, leaves none).

`modeled_steps` prices a run's own rounds in the same units, so `auto` and the fixed layouts
compare to the bound on the cost model, never on this machine's noisy clock.
"""

from __future__ import annotations

import heapq
import math

from selfspec.engine.layouts import AR, Option, fixed_option


def rank_tree(profile, nodes: int, max_depth: int = 64) -> frozenset:
    """The `nodes` rank paths (tuples of 0 = top-1, 1 = second) up to `max_depth` deep with the
    most probability under the profile (a path's children come after it)."""
    def prob(path):
        out = 1.0
        for d, r in enumerate(path, 1):
            p1, s = profile.at(d)
            out *= p1 if r == 0 else (1 - p1) * s
        return out

    heap, out = [(-prob((0,)), (0,)), (-prob((1,)), (1,))], []
    while heap and len(out) < nodes:
        _, path = heapq.heappop(heap)
        out.append(path)
        for r in (0, 1) if len(path) < max_depth else ():
            heapq.heappush(heap, (-prob(path + (r,)), path + (r,)))
    return frozenset(out)


def candidates(profile, cfg) -> list[tuple[Option, frozenset, bool, bool]]:
    """(option, rank paths it drafts, needs marginals, leaves marginals)."""
    B = cfg.block_length
    out = [(AR, frozenset(), False, False), (Option("none", 0, 1, B), frozenset(), False, True)]
    n, budgets = 1, set()
    while n < cfg.budget:
        budgets.add(n)
        n *= 2
    budgets.add(cfg.budget)
    for n in sorted(budgets):
        chain = frozenset(tuple([0] * k) for k in range(1, min(n, B - 1) + 1))
        for draft, paths in (("chain", chain), ("tree", rank_tree(profile, n, B - 1))):
            k = len(paths)
            out += [(Option(draft, k, k + 1, B), paths, True, True), (Option(draft, k), paths, True, False),
                    (Option(draft, k, draft_pass=True), paths, False, False)]
    return out


def committed(replay, row: int, emitted: int, paths: frozenset) -> int:
    """Tokens a round commits when `emitted` tokens are out (its root the last) and it drafts
    `paths`: the accepted path and the bonus."""
    path: tuple = ()
    while True:
        d = len(path) + 1
        o = replay.outcome(row, emitted - 1 + d, d)
        if o > 1 or path + (o,) not in paths:
            return len(path) + 1
        path += (o,)


def hindsight_steps(replay, row: int, *, new_tokens: int, prompt_len: int, cost, cfg, plan=None) -> float:
    """The least cost (AR steps) of emitting tokens 1 .. new_tokens - 1 (the first comes with the
    prefill, as do its marginals), each round one candidate, knowing every outcome. `plan` (a
    dict): the bound's rounds by layout label are added to it."""
    cands = candidates(replay.profile, cfg)
    steps: dict = {}

    def price(o: Option, cache: int) -> float:
        key = (o, cache // 64)
        if key not in steps:
            steps[key] = cost.ar_steps(o, block_length=cfg.block_length, cache=prompt_len + 64 * (cache // 64))
        return steps[key]

    best = {(new_tokens, False): (0.0, None), (new_tokens, True): (0.0, None)}
    for e in range(new_tokens - 1, 0, -1):
        for marg in (False, True):
            v = (math.inf, None)
            for o, paths, needs, leaves in cands:
                if needs and not marg:
                    continue
                nxt = (min(e + (committed(replay, row, e, paths) if paths else 1), new_tokens), leaves)
                v = min(v, (price(o, e) + best[nxt][0], (o, nxt)), key=lambda x: x[0])
            best[(e, marg)] = v
    state = (1, True)
    while plan is not None and best.get(state, (0, None))[1] is not None:
        o, state = best[state][1]
        plan[o.label] = plan.get(o.label, 0) + 1
    return best[(1, True)][0] if new_tokens > 1 else 0.0


def option_of(label: str) -> Option:
    """A round's layout label (`Option.label`) back to its option (padding aside)."""
    if label == "ar":
        return AR
    parts = label.split("/")
    kv = dict(p.split("=") for p in parts if "=" in p)
    nodes = int(kv.get("N", 0))
    draft = "lookup" if parts[0] == "lookup" else "chain" if parts[0] == "linear" else "tree" if nodes else "none"
    return Option(draft, nodes, int(kv.get("m", 0)), int(kv.get("G", 0)), draft_pass="two-pass" in parts)


def modeled_steps(rounds: list[tuple[str, int]], cfg, cost, prompt_len: int) -> float:
    """A run's rounds [(layout label, cache length before it)] priced in AR steps: a fixed mode's
    rounds by its option, auto's by their labels."""
    fixed = None if cfg.plan == "auto" else fixed_option(cfg)
    return sum(cost.ar_steps(fixed or option_of(label), block_length=cfg.block_length, cache=c)
               for label, c in rounds)


def replay_label(name: str) -> str:
    return f"replayed acceptance (profile {name})"


def replayed(dec, cfg, seen: list[tuple[str, int]], prompt_len: int, cost) -> dict:
    """A replayed bench record's extra fields: its rounds priced on the cost model and, for a
    plan "auto" row, the hindsight bound for the same prompt and tokens."""
    rep = dec.stepper.replay
    out = {"replay": replay_label(rep.name), "modeled_steps": modeled_steps(seen, cfg, cost, prompt_len)}
    if cfg.plan == "auto":
        plan: dict = {}
        out["hindsight_steps"] = hindsight_steps(rep, 0, new_tokens=len(dec.outputs[0]), prompt_len=prompt_len,
                                                 cost=cost, cfg=cfg, plan=plan)
        out["hindsight_plan"] = plan
    return out


def replay_figures(records: list[dict]) -> dict:
    """A replayed row's speedups over AR on the cost model: its own rounds', and (auto) the
    hindsight bound's and its share of it."""
    tokens = sum(r.get("round_tokens", 0) for r in records)
    steps = sum(r.get("modeled_steps", 0.0) for r in records)
    out = {"modeled_speedup": tokens / steps if steps else None}
    if all("hindsight_steps" in r for r in records) and records:
        bound = sum(r["hindsight_steps"] for r in records)
        out["hindsight_speedup"] = tokens / bound if bound else None
        out["of_hindsight"] = bound / steps if steps else None
        plan: dict = {}
        for r in records:
            for k, v in r.get("hindsight_plan", {}).items():
                plan[k] = plan.get(k, 0) + v
        out["hindsight_plan"] = dict(sorted(plan.items(), key=lambda kv: -kv[1]))
    return out


def replay_lines(rows: list[dict]) -> list[str]:
    """The lines a replayed bench prints under its table, each naming the replay."""
    lines = []
    for r in rows:
        if r.get("modeled_speedup") is None:
            continue
        line = (f"{r['replay']}: {r['label']}: tau {r['tau']:.2f}, TPF {r['tpf']:.2f}, "
                f"{r['modeled_speedup']:.2f}x AR on the cost model")
        if r.get("hindsight_speedup") is not None:
            top = ", ".join(f"{k} {v}" for k, v in list(r["hindsight_plan"].items())[:3])
            line += (f"; hindsight bound {r['hindsight_speedup']:.2f}x AR ({top}), auto at {r['of_hindsight']:.2f} "
                     f"of it")
        lines.append(line)
    return lines


def replay_arg(a, batch: bool):
    """bench --replay's profile (before the model loads); a replayed run is greedy, one prompt at a
    time (its temperatures set to [0])."""
    if a.replay is None:
        return None
    from selfspec.drafting.replay import load_profile

    if batch:
        raise ValueError("--replay runs one prompt at a time (not with --batch-sizes)")
    temps = [a.temperature] if a.temperature is not None else a.temperatures
    if "--temperatures" in a.argv or a.temperature is not None:
        if any(t > 0 for t in temps):
            raise ValueError("--replay replays greedy acceptance against the AR output: it needs temperature 0")
    a.temperatures, a.temperature = [0.0], None
    return load_profile(a.replay)
