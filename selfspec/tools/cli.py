"""Command line: `python -m selfspec generate | chat | serve | bench | trace | profile | convert | info ...`."""

from __future__ import annotations

import json
import sys

from selfspec.tools.args import (Parser, add_common_args, add_layout_args, add_replay_arg, check_profile_arg,
                                 check_replay_arg, decode_kwargs)


def _read_prompt(a):
    if getattr(a, "chat", None) is not None:
        if not a.chat.strip():
            raise ValueError("empty --chat message")
        return [{"role": "user", "content": a.chat}]
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
    from selfspec.kernels import build

    cfg = gen.decoder.cfg
    rec = {"text": gen.text, "token_ids": gen.token_ids, **gen.stats.as_dict(), "mode": cfg.mode, "plan": cfg.plan,
           "schedule": None if cfg.mode in ("ar", "auto", "lookup") else (cfg.schedule or "auto"), "block_length": a.block_length,
           "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p, "finish_reason": gen.finish_reason,
           "kernels": build.state()}
    if cfg.mode in ("presto", "auto"):
        rec.update(budget=a.budget, rho=a.rho, lam=a.lam, tree_top_k=a.tree_top_k)
    if rec["replay"] is not None:
        rec["note"] = f"replayed acceptance (profile {rec['replay']})"
    return rec


def cmd_generate(a) -> int:
    if getattr(a, "batch_size", None) is not None:  # many prompts: selfspec.tools.batch_cli
        if a.replay is not None:
            raise ValueError("--replay runs one prompt (bench --replay runs a prompt file)")
        from selfspec.tools.batch_cli import cmd_generate_batch

        return cmd_generate_batch(a)
    from selfspec.engine.round.rounds import config_label
    from selfspec.engine.request.options import DecodeConfig
    from selfspec.loading import load
    from selfspec.streaming import stream

    cfg = DecodeConfig(**decode_kwargs(a))  # bad options fail before the model loads
    check_profile_arg(a, cfg)
    if a.chat is not None:
        from selfspec.checkpoint.synthetic import refuse

        refuse(a.model, "`generate --chat`")  # before its minutes of building
    replay = check_replay_arg(a, cfg)
    prompt = _read_prompt(a)
    if a.stop and not all(a.stop):
        raise ValueError("stop strings must be non-empty")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries only the stats line or one error line
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, device_map=a.device_map,
                      kv_cache_dtype=a.kv_cache_dtype)
    gen = stream(model, tok, prompt, seed=a.seed, stop=a.stop or None, profile=a.profile, replay=replay,
                 **decode_kwargs(a))
    note = layout_note(model, cfg, a.profile)  # after the request's checks: bad input is one error line
    if note:
        print(note, file=sys.stderr)
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
        layouts = ""
        if cfg.mode == "presto" and cfg.plan == "auto":  # say what the device could afford
            hist = sorted(s["plan_hist"].items(), key=lambda kv: -kv[1])
            layouts = "; rounds by layout: " + ", ".join(f"{k} {v}" for k, v in hist[:4])
        replayed = "" if replay is None else f" [replayed acceptance (profile {replay.name})]"
        print(f"[{config_label(cfg)}]{replayed} {s['new_tokens']} tokens, {s['rounds']} rounds, "
              f"tau {s['tau']:.2f}, TPF {s['tpf']:.2f}, {s['tokens_per_second']:.1f} tok/s{layouts}", file=sys.stderr)
    return 0


STEPS_NOTED = 4.0  # a fixed layout whose round costs this many AR steps or more is named before it runs


def layout_note(model, cfg, profile=None) -> str | None:
    """A line said before a PRESTO or linear generation starts: what its rounds cost on this device.

    PRESTO laid out per round (no schedule named): that the planner lays it out, and what the
    paper's layout would cost here. A fixed PRESTO / linear layout: its cost in AR steps when that
    is STEPS_NOTED or more, from the cost model when one is given or cached (a fixed mode does not
    measure one just to say this)."""
    import os

    from selfspec.engine.measure.cost import CostModel, cost_model, default_path
    from selfspec.engine.round.rounds import config_label, fixed_option
    from selfspec.engine.request.options import DecodeConfig

    if cfg.mode not in ("presto", "linear"):
        return None
    if cfg.plan == "auto":
        cost = cost_model(model, profile)
        paper = fixed_option(DecodeConfig(mode="presto", schedule="one-pass", budget=cfg.budget,
                                          block_length=cfg.block_length, group_size=cfg.group_size))
        steps = cost.ar_steps(paper, block_length=cfg.block_length)
        return (f"note: PRESTO is laid out per round as this device affords (trees of up to {cfg.budget} nodes, "
                f"one- or two-pass, fewer mask groups, or AR where no tree pays); the paper's layout (one-pass, a "
                f"mask group on every node: {paper.width} query tokens a round) would cost ~{steps:.0f} AR steps a "
                f"round here. --schedule one-pass runs it.")
    path = profile or default_path(model)
    if isinstance(path, str) and not os.path.isfile(path):
        return None
    try:
        cost = path if isinstance(path, CostModel) else CostModel.load(path)
    except (ValueError, FileNotFoundError):
        return None
    option = fixed_option(cfg)
    steps = cost.ar_steps(option, block_length=cfg.block_length)
    if steps < STEPS_NOTED:
        return None
    return (f"note: a round of {config_label(cfg)} ({option.width} query tokens) costs ~{steps:.0f} AR steps on this "
            f"device (its cost model), so it is faster than AR only where rounds commit more than ~{steps:.0f} tokens"
            + (" on average; leave --schedule unset to lay PRESTO out for this device." if cfg.mode == "presto" else "."))


def _cmd_convert(a) -> int:
    from selfspec.checkpoint.convert import main as convert_main

    return convert_main(a)


def main(argv=None) -> int:
    ap = Parser(prog="python -m selfspec", description="Self-speculative decoding with diffusion LMs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="stream a continuation of a prompt")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file whose whole content is the prompt")
    src.add_argument("--chat", help="one user message, sent through the model's chat template")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print one JSON record instead of streaming text")
    add_layout_args(g)
    add_replay_arg(g)
    g.add_argument("--batch-size", type=int, default=None,
                   help="decode the prompts of --prompt-file (JSON lines) in batches of this many rows")
    add_common_args(g)
    g.set_defaults(func=cmd_generate)
    from selfspec.tools.bench_args import add_bench_parser

    add_bench_parser(sub, add_common_args)
    from selfspec.tools.commands import add_profile_parser, add_trace_parser

    add_profile_parser(sub)
    add_trace_parser(sub, add_common_args)
    from selfspec.tools.chat import add_chat_parser

    add_chat_parser(sub, add_common_args)
    from selfspec.tools.info import add_info_parser

    add_info_parser(sub)
    from selfspec.tools.serve_cli import add_serve_parser

    add_serve_parser(sub)
    c = sub.add_parser("convert", help="convert a Llama GGUF file or transformers Llama folder into an NLD checkpoint")
    c.add_argument("src", help="a .gguf file (llama architecture) or a transformers Llama directory")
    c.add_argument("out", help="output checkpoint folder (must not exist, or be empty)")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="stored weight dtype")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_cmd_convert)
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
