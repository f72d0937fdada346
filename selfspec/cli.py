"""Command line: `python -m selfspec generate ...`, `python -m selfspec bench ...` and `python -m selfspec trace ...`."""

from __future__ import annotations

import argparse
import json
import sys


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2, like every other bad input."""

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _add_common_args(p: argparse.ArgumentParser) -> None:
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
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default cpu)")
    p.add_argument("--device-map", default=None, help="accelerate device map, e.g. auto (spreads layers over GPUs)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--lookup", default=None, choices=["on", "off"],
                   help="add each path's context continuations to PRESTO's candidates (default: on for --plan auto)")
    p.add_argument("--lookup-min-ngram", type=int, default=1, help="context lookup: shortest n-gram matched")
    p.add_argument("--lookup-max-ngram", type=int, default=3, help="context lookup: longest n-gram matched")
    p.add_argument("--lookup-tokens", type=int, default=10, help="--mode lookup: tokens copied per round")
    p.add_argument("--profile", default=None,
                   help="cost-profile JSON for --plan auto (default: measured once per device/model/dtype and cached)")


def _decode_kwargs(a) -> dict:
    return dict(mode=a.mode, plan=a.plan, lookup=None if a.lookup is None else a.lookup == "on",
                lookup_min_ngram=a.lookup_min_ngram, lookup_max_ngram=a.lookup_max_ngram, lookup_tokens=a.lookup_tokens,
                schedule=a.schedule, block_length=a.block_length, group_size=a.group_size, group_nodes=a.group_nodes,
                max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                budget=a.budget, tree_top_k=a.tree_top_k, lam=a.lam, rho=a.rho, draft_lora=not a.no_draft_lora)


def _read_prompt(a) -> str:
    if a.prompt_file is None:
        prompt = a.prompt
    else:
        name = a.prompt_file
        try:
            with open(name, encoding="utf-8") as f:
                prompt = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"prompt file {name} not found") from None
        except IsADirectoryError:
            raise ValueError(f"prompt file {name} is a directory") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt file {name} is not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise ValueError(f"prompt file {name} cannot be read: {e.strerror}") from None
    if not prompt:
        raise ValueError("empty prompt" + (f" (prompt file {a.prompt_file})" if a.prompt_file else ""))
    return prompt


def _record(a, gen) -> dict:
    cfg = gen.decoder.cfg
    rec = {"text": gen.text, "token_ids": gen.token_ids, **gen.stats.as_dict(), "mode": cfg.mode, "plan": cfg.plan,
           "schedule": None if cfg.mode in ("ar", "auto") else a.schedule, "block_length": a.block_length,
           "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p, "finish_reason": gen.finish_reason}
    if cfg.mode in ("presto", "auto"):
        rec.update(budget=a.budget, rho=a.rho, lam=a.lam, tree_top_k=a.tree_top_k)
    return rec


def cmd_generate(a) -> int:
    from .config import DecodeConfig
    from .model import load
    from .streaming import stream

    cfg = DecodeConfig(**_decode_kwargs(a))  # bad options fail before the model loads
    if a.profile is not None:
        from .profile import CostProfile

        CostProfile.load(a.profile)
    prompt = _read_prompt(a)
    if a.stop and not all(a.stop):
        raise ValueError("stop strings must be non-empty")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries only the stats line or one error line
    model, tok = load(a.model, dtype=a.dtype, device=a.device, device_map=a.device_map)
    gen = stream(model, tok, prompt, seed=a.seed, stop=a.stop or None, profile=a.profile, **_decode_kwargs(a))
    try:
        for delta in gen:
            if not a.json:
                sys.stdout.write(delta)
                sys.stdout.flush()
    except KeyboardInterrupt:
        # Ctrl-C: keep what was streamed, end the line, no stats and no traceback
        if a.json:
            print(json.dumps(_record(a, gen)))
        else:
            sys.stdout.write("\n")
        sys.stdout.flush()
        return 130
    s = gen.stats.as_dict()
    if a.json:
        print(json.dumps(_record(a, gen)))
    else:
        sys.stdout.write("\n")
        print(f"[{cfg.mode}/{a.schedule if cfg.mode not in ('ar', 'auto') else '-'}] {s['new_tokens']} tokens, {s['rounds']} rounds, "
              f"tau {s['tau']:.2f}, TPF {s['tpf']:.2f}, {s['tokens_per_second']:.1f} tok/s", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = _Parser(prog="python -m selfspec", description="Self-speculative decoding with diffusion LMs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a continuation of a prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON record instead of streaming text")
    g.add_argument("--plan", default=None, choices=["auto", "fixed"],
                   help="auto (default): choose every round's layout from this device's cost profile; "
                        "fixed: the layout the flags give (naming --mode implies fixed)")
    g.add_argument("--mode", default=None, choices=["auto", "ar", "linear", "presto", "lookup"],
                   help="force a layout (default: chosen by --plan auto; --plan fixed alone means presto)")
    g.add_argument("--schedule", default="one-pass", choices=["two-pass", "one-pass"])
    g.add_argument("--budget", type=int, default=32, help="PRESTO draft nodes under the root (root excluded)")
    _add_common_args(g)
    g.set_defaults(func=cmd_generate)
    from .bench import add_bench_parser

    add_bench_parser(sub, _add_common_args)
    from .profile import add_profile_parser

    add_profile_parser(sub)
    from .trace import add_trace_parser

    add_trace_parser(sub, _add_common_args)
    a = ap.parse_args(argv)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return a.func(a)
    except (ValueError, FileNotFoundError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)  # always one line
        return 2
    except KeyboardInterrupt:  # before any text was streamed (loading, warm-up, bench)
        sys.stdout.write("\n")
        sys.stdout.flush()
        return 130
