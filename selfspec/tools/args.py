"""Arguments shared by the subcommands: the decoding flags and their mapping to `DecodeConfig`."""

from __future__ import annotations

import argparse


class Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2, like every other bad input."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def add_layout_args(p: argparse.ArgumentParser) -> None:
    """--plan, --mode, --schedule, --budget: how rounds are laid out (generate and serve)."""
    p.add_argument("--plan", default=None, choices=["auto", "fixed"],
                   help="auto (default): each round's layout from this device's cost model (measured once, "
                        "cached); fixed: the layout the flags give (naming --mode implies fixed)")
    p.add_argument("--mode", default=None, choices=["auto", "ar", "linear", "presto", "lookup"],
                   help="force a layout for every round (default: chosen by --plan auto; --plan fixed alone "
                        "means presto)")
    p.add_argument("--schedule", default=None, choices=["two-pass", "one-pass"],
                   help="--mode presto: unset (default), each round is laid out as this device affords (PRESTO "
                        "trees, fewer mask groups, two-pass, or AR where no tree pays, from the cost model); "
                        "one-pass with every node's mask group is the paper's layout (wide rounds: slow on a CPU); "
                        "--mode linear: one-pass unless named")
    p.add_argument("--budget", type=int, default=32, help="PRESTO draft nodes under the root (root excluded)")


def add_replay_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replay", default=None, metavar="PROFILE",
                   help="replayed acceptance: the draft marginals replaced by a profile's calibrated ones (a built-in "
                        "such as nld-8b, or a JSON file), drawn against the greedy AR output; T = 0 only; the output "
                        "is still verified (docs/replay.md)")


def check_replay_arg(a, cfg):
    """--replay's profile, loaded before the model (a bad one is one error line); None without it."""
    if getattr(a, "replay", None) is None:
        return None
    from selfspec.drafting.replay import load_profile

    if cfg.temperature > 0:
        raise ValueError("--replay replays greedy acceptance against the AR output: it needs --temperature 0")
    return load_profile(a.replay)


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the shipped model)")
    p.add_argument("--block-length", type=int, default=16, help="draft block / mask-group length B")
    p.add_argument("--group-size", type=int, default=None, help="one-pass mask-group size (default B)")
    p.add_argument("--group-nodes", type=int, default=None, help="one-pass: nodes that get a group (default all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k, as in transformers (0 = off)")
    p.add_argument("--tree-top-k", type=int, default=4, help="PRESTO candidates per depth")
    p.add_argument("--lam", type=float, default=0.2, help="PRESTO lambda")
    p.add_argument("--rho", default="ngram", choices=["none", "ngram", "learned"])
    p.add_argument("--no-draft-lora", action="store_true", help="ignore the checkpoint's linear_spec_lora adapter")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sampling", default="reproducible", choices=["reproducible", "independent"],
                   help="randomness at T > 0: keyed by seed and output position (the same seed gives the same "
                        "tokens in every mode) or one draw per tree node")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default cpu)")
    p.add_argument("--device-map", default=None, help="accelerate device map, e.g. auto (spreads layers over GPUs)")
    add_weights_args(p)
    p.add_argument("--lookup", default=None, choices=["on", "off"],
                   help="add each path's context continuations to PRESTO's candidates (default: on for --plan auto)")
    p.add_argument("--lookup-min-ngram", type=int, default=1, help="context lookup: shortest n-gram matched")
    p.add_argument("--lookup-max-ngram", type=int, default=3, help="context lookup: longest n-gram matched")
    p.add_argument("--lookup-tokens", type=int, default=10, help="--mode lookup: tokens copied per round")
    p.add_argument("--profile", default=None,
                   help="cost-profile JSON for --plan auto (default: measured once per device/model/dtype and cached)")


def add_weights_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default=None, choices=["auto", "fp32", "bf16", "int8", "int4", "w4a8"],
                   help="weight format (default auto on a CPU: the fastest exact format that passes the quality "
                        "check here, measured once; $SELFSPEC_WEIGHTS sets the default)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 for a plain load (default: the "
                   "weight format's; bf16 on CUDA)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "int16", "int8"],
                   help="the exact formats' KV cache: auto (default; $SELFSPEC_KV_CACHE_DTYPE sets it: int8 for "
                        "w4a8 and int8 weights, int16 for the others), int16, or int8 (half the bytes per cached "
                        "token, faster decoding at long contexts, a little quality: docs/results.md)")


def decode_kwargs(a) -> dict:
    return dict(mode=a.mode, plan=a.plan, lookup=None if a.lookup is None else a.lookup == "on",
                lookup_min_ngram=a.lookup_min_ngram, lookup_max_ngram=a.lookup_max_ngram, lookup_tokens=a.lookup_tokens,
                schedule=a.schedule, block_length=a.block_length, group_size=a.group_size, group_nodes=a.group_nodes,
                max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                budget=a.budget, tree_top_k=a.tree_top_k, lam=a.lam, rho=a.rho, draft_lora=not a.no_draft_lora,
                sampling=getattr(a, "sampling", "reproducible"))


def check_profile_arg(a, cfg) -> None:
    """--profile: a readable cost model, and only with --plan auto (checked before the model loads)."""
    if a.profile is None:
        return
    from selfspec.engine.measure.cost import CostModel

    if cfg.plan != "auto":
        raise ValueError("--profile is read by --plan auto only; this generation runs a fixed mode")
    CostModel.load(a.profile)
