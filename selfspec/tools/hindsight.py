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

import math

from selfspec.engine.round.rounds import AR, Option, fixed_option


def rank_tree(profile, nodes: int, max_depth: int = 64) -> frozenset:
    """The `nodes` rank paths (tuples of 0 = top-1, 1 = second) up to `max_depth` deep with the
    most probability under the profile (a path's children come after it)."""
    return frozenset(path for path, _ in profile.rank_paths(nodes, max_depth))


def candidates(profile, cfg) -> list[tuple[Option, tuple, int, int]]:
    """`auto`'s own options (`planner.Planner`'s budgets and group sizes), each as (option, the
    rank paths it drafts, the marginals' reach it needs (0: none), the reach it leaves (0: none)).
    A group of G slots gives marginals G - 1 deep; a draft pass, block_length - 1. Trees only: `auto`
    never drafts a top-1 chain (a max-probability tree holds at least as many expected tokens), so
    the bound takes none either (it once did, which let hindsight pick the chain exactly where
    the top-1 run was long). One-pass rounds put a group on every node (`auto` may put fewer)."""
    from selfspec.engine.planning.planner import default_group_sizes, log2_budgets

    B = cfg.block_length
    sizes = default_group_sizes(cfg.group)
    out = [(AR, (), 0, 0)] + [(Option("none", 0, 1, g), (), 0, g - 1) for g in sizes]
    reaches = sorted({g - 1 for g in sizes} | {B - 1})
    for n in log2_budgets(cfg.budget):
        two = rank_tree(profile, n, B - 1)
        out.append((Option("tree", len(two), draft_pass=True), two, 0, 0))
        shallower = None
        for r in reaches:
            paths = rank_tree(profile, n, r)
            if paths == shallower:
                continue  # the same tree as a shallower reach's: offered there (needing less)
            shallower, k = paths, len(paths)
            out += [(Option("tree", k), paths, r, 0)] + [(Option("tree", k, k + 1, g), paths, r, g - 1) for g in sizes]
    return out


def committed(replay, row: int, emitted: int, paths) -> int:
    """Tokens a round commits when `emitted` tokens are out (its root the last) and it drafts
    `paths`: the accepted path and the bonus."""
    path: tuple = ()
    while True:
        d = len(path) + 1
        o = replay.outcome(row, emitted - 1 + d, d)
        if o > 1 or path + (o,) not in paths:
            return len(path) + 1
        path += (o,)


def commit_odds(profile, paths) -> dict[int, float]:
    """What a round drafting `paths` commits, in expectation over the profile's draws: {tokens:
    probability}. A path is reached with the product of its ranks' odds; the round stops at it
    when neither child it holds is the true token."""
    paths = set(paths)
    out: dict[int, float] = {}

    def walk(path, p):
        d = len(path) + 1
        p1, s = profile.at(d)
        go = 0.0
        for r, q in ((0, p1), (1, (1 - p1) * s)):
            if path + (r,) in paths:
                go += q
                walk(path + (r,), p * q)
        out[len(path) + 1] = out.get(len(path) + 1, 0.0) + p * (1.0 - go)

    walk((), 1.0)
    return out


def _pricer(cost, cfg, prompt_len: int):
    steps: dict = {}

    def price(o: Option, cache: int) -> float:
        key = (o, cache // 64)
        if key not in steps:
            steps[key] = cost.ar_steps(o, block_length=cfg.block_length, cache=prompt_len + 64 * (cache // 64))
        return steps[key]
    return price


def _start(cfg) -> int:
    """The reach of the first round's marginals: the prefill's group (cfg.group), bought at no
    cost here as in `modeled_steps` (a prefill is no round); `auto` takes it when it bets."""
    return cfg.group - 1


def hindsight_steps(replay, row: int, *, new_tokens: int, prompt_len: int, cost, cfg, plan=None) -> float:
    """The least cost (AR steps) of emitting tokens 1 .. new_tokens - 1 (the first comes with the
    prefill, as do its marginals), each round one of `auto`'s options, knowing every outcome.
    `plan` (a dict): the bound's rounds by layout label are added to it."""
    cands, price = candidates(replay.profile, cfg), _pricer(cost, cfg, prompt_len)
    reaches = sorted({0} | {c[3] for c in cands} | {_start(cfg)})
    best = {(new_tokens, r): (0.0, None) for r in reaches}
    for e in range(new_tokens - 1, 0, -1):
        for r in reaches:
            v = (math.inf, None)
            for o, paths, needs, leaves in cands:
                if needs > r:  # it drafts from marginals at least this deep
                    continue
                nxt = (min(e + (committed(replay, row, e, paths) if paths else 1), new_tokens), leaves)
                v = min(v, (price(o, e) + best[nxt][0], (o, nxt)), key=lambda x: x[0])
            best[(e, r)] = v
    state = (1, _start(cfg))
    while plan is not None and best.get(state, (0, None))[1] is not None:
        o, state = best[state][1]
        plan[o.label] = plan.get(o.label, 0) + 1
    return best[(1, _start(cfg))][0] if new_tokens > 1 else 0.0


def expected_steps(profile, *, new_tokens: int, prompt_len: int, cost, cfg) -> float:
    """The same least cost for a planner that knows the profile but not the outcomes (the best
    `auto` can do, in expectation: under replay the marginals state the profile's odds and the
    draws are independent, so nothing else foretells a round): each round one of `auto`'s options
    chosen by the expected cost of the rest (a Markov decision process over tokens emitted and
    the marginals' reach)."""
    cands, price = candidates(profile, cfg), _pricer(cost, cfg, prompt_len)
    odds = {id(paths): commit_odds(profile, paths) for _, paths, _, _ in cands if paths}
    reaches = sorted({0} | {c[3] for c in cands} | {_start(cfg)})
    best = {(e, r): 0.0 for e in range(new_tokens, new_tokens + 64) for r in reaches}
    for e in range(new_tokens - 1, 0, -1):
        for r in reaches:
            v = math.inf
            for o, paths, needs, leaves in cands:
                if needs > r:
                    continue
                rest = sum(p * best[(min(e + j, new_tokens), leaves)] for j, p in odds[id(paths)].items()) \
                    if paths else best[(e + 1, leaves)]
                v = min(v, price(o, e) + rest)
            best[(e, r)] = v
    return best[(1, _start(cfg))] if new_tokens > 1 else 0.0


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
        out["expected_steps"] = expected_steps(rep.profile, new_tokens=len(dec.outputs[0]), prompt_len=prompt_len,
                                               cost=cost, cfg=cfg)
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
    if all("expected_steps" in r for r in records) and records:
        best = sum(r["expected_steps"] for r in records)
        out["expected_speedup"] = tokens / best if best else None
        out["of_expected"] = best / steps if steps else None
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
        if r.get("expected_speedup") is not None:
            line += (f"; best without hindsight {r['expected_speedup']:.2f}x AR in expectation, auto at "
                     f"{r['of_expected']:.2f} of it")
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
