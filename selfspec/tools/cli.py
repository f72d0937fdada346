"""Command line: `python -m selfspec generate | chat | serve | bench | trace | profile | convert ...`."""

from __future__ import annotations

import json
import sys

from selfspec.tools.args import Parser, add_common_args, add_layout_args, check_profile_arg, decode_kwargs


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
    cfg = gen.decoder.cfg
    rec = {"text": gen.text, "token_ids": gen.token_ids, **gen.stats.as_dict(), "mode": cfg.mode, "plan": cfg.plan,
           "schedule": None if cfg.mode in ("ar", "auto") else a.schedule, "block_length": a.block_length,
           "temperature": a.temperature, "top_k": a.top_k, "top_p": a.top_p, "finish_reason": gen.finish_reason}
    if cfg.mode in ("presto", "auto"):
        rec.update(budget=a.budget, rho=a.rho, lam=a.lam, tree_top_k=a.tree_top_k)
    return rec


def cmd_generate(a) -> int:
    if getattr(a, "batch_size", None) is not None:  # many prompts: selfspec.tools.batch_cli
        from selfspec.tools.batch_cli import cmd_generate_batch

        return cmd_generate_batch(a)
    from selfspec.engine.options import DecodeConfig
    from selfspec.loading import load
    from selfspec.streaming import stream

    cfg = DecodeConfig(**decode_kwargs(a))  # bad options fail before the model loads
    check_profile_arg(a, cfg)
    prompt = _read_prompt(a)
    if a.stop and not all(a.stop):
        raise ValueError("stop strings must be non-empty")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries only the stats line or one error line
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, device_map=a.device_map)
    gen = stream(model, tok, prompt, seed=a.seed, stop=a.stop or None, profile=a.profile, **decode_kwargs(a))
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
    g.add_argument("--batch-size", type=int, default=None,
                   help="decode the prompts of --prompt-file (JSON lines) in batches of this many rows")
    add_common_args(g)
    g.set_defaults(func=cmd_generate)
    from selfspec.tools.bench import add_bench_parser

    add_bench_parser(sub, add_common_args)
    from selfspec.tools.commands import add_profile_parser, add_trace_parser

    add_profile_parser(sub)
    add_trace_parser(sub, add_common_args)
    from selfspec.tools.chat import add_chat_parser

    add_chat_parser(sub, add_common_args)
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
