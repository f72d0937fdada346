"""What a real NLD model's drafts would give: replayed acceptance (docs/replay.md).

The forward runs as usual, but the draft marginals are replaced by a profile's calibrated ones
(default `nld-8b`, fitted to NLD-8B's published linear tokens per forward), drawn against each
prompt's greedy AR output; the output is still verified, so it equals AR's. Prints replayed
linear tokens per forward at blocks 8 / 16 / 32 beside the published figures, then `auto`'s tau.

    python examples/replay_nld.py --model models/pystdlib-nld-9m --limit 4 --max-new-tokens 128
    python examples/replay_nld.py --profile my_profile.json   # {"name", "top1": [...], "rank2": [...]}
"""

import argparse
import json
import os

import selfspec
from selfspec.engine.request.stats import Stats

PUBLISHED = {8: 3.21, 16: 4.75, 32: 5.96}  # NLD-8B, linear self-speculation, nine-set mean


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--profile", default="nld-8b")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--blocks", nargs="+", type=int, default=list(PUBLISHED), help="linear blocks (default 8 16 32)")
    ap.add_argument("--no-auto", action="store_true", help="the linear fit only (docs/replay.md's measuring run)")
    a = ap.parse_args()
    model, tok = selfspec.load(a.model)
    path = os.path.join(a.model or selfspec.default_model_dir(), "prompts.jsonl")
    with open(path) as f:
        prompts = [json.loads(line)["prompt"] for line in f][: a.limit]
    run = dict(max_new_tokens=a.max_new_tokens, eos_token_id=[], replay=a.profile)
    for block in a.blocks:
        published = PUBLISHED.get(block, "none")
        stats = [selfspec.generate(model, tok, p, mode="linear", block_length=block, **run).stats for p in prompts]
        total = Stats.total(stats)
        print(f"replayed acceptance (profile {total.replay}): linear block {block}: TPF {total.tpf:.2f} "
              f"(published {published}; {len(prompts)} prompts, {total.rounds} rounds)")
    if a.no_auto:
        return
    stats = Stats.total([selfspec.generate(model, tok, p, mode="auto", **run).stats for p in prompts])
    print(f"replayed acceptance (profile {stats.replay}): auto: tau {stats.tau:.2f}, TPF {stats.tpf:.2f}, "
          f"rounds by layout {dict(stats.plan_hist.most_common(4))}")


if __name__ == "__main__":
    main()
