"""`python -m selfspec chat`: an interactive, streaming, multi-turn conversation.

Each turn applies the model's chat template to the whole conversation and streams the answer
until the template's end-of-turn token (the model's eos); it continues in the previous turn's KV
cache (`stream(past=...)`), so only the new message is prefilled, not the history. Ctrl-C while an answer streams stops
that answer (what was shown stays in the conversation) and returns to the prompt; Ctrl-C or
Ctrl-D at the prompt ends the session. `/reset` starts a new conversation, `/exit` leaves.

Sampling follows the model: --temperature / --top-p / --top-k win where given, the others come
from the checkpoint's `generation_config.json` (`checkpoint.generation`, transformers' meaning:
sampled only with `do_sample`), else greedy. A small model answering greedily loops on harder
requests; the default model's file holds its card's recommendation (temperature 0.2, top-p 0.9).
`generate` stays greedy unless asked, like transformers' `generate`.
"""

from __future__ import annotations

import sys


def chat_turn(model, tok, messages: list[dict], out, past=None, **kw):
    """Stream one assistant answer to `out`; returns the finished or interrupted `Generation`.
    `past`: the previous turn's, whose KV cache this one continues in (the history is not
    prefilled again)."""
    from selfspec.streaming import stream

    gen = stream(model, tok, messages, past=past, **kw)
    try:
        for delta in gen:
            out.write(delta)
            out.flush()
    except KeyboardInterrupt:
        pass  # finish_reason is "interrupted"; the partial answer stays in the conversation
    out.write("\n")
    out.flush()
    messages.append({"role": "assistant", "content": gen.text})
    return gen


def run_chat(model, tok, *, inp=None, out=None, err=None, system: str | None = None, show_stats: bool = False,
             **kw) -> int:
    from selfspec.checkpoint.synthetic import refuse

    refuse(tok, "chat")
    inp, out, err = inp or sys.stdin, out or sys.stdout, err or sys.stderr
    if not getattr(tok, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use `generate --prompt` instead")
    base = [{"role": "system", "content": system}] if system else []
    messages, gen = list(base), None
    interactive = inp.isatty() if hasattr(inp, "isatty") else False
    err.write("chat: Ctrl-C stops an answer, Ctrl-D (or /exit) leaves, /reset forgets the conversation\n")
    while True:
        try:
            if interactive:
                out.write("> ")
                out.flush()
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        if not line:
            return 0
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            messages, gen = list(base), None
            continue
        messages.append({"role": "user", "content": text})
        gen = chat_turn(model, tok, messages, out, past=gen, **kw)
        if show_stats:
            s = gen.stats.as_dict()
            err.write(f"[{s['new_tokens']} tokens, tau {s['tau']:.2f}, {s['tokens_per_second']:.1f} tok/s, "
                      f"{gen.finish_reason}]\n")


SAMPLING = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}  # the flags a checkpoint's file fills, at "off"


def model_sampling(kw: dict, checkpoint_dir) -> tuple[dict, list[str]]:
    """`kw` with the sampling flags it leaves at None filled from `checkpoint_dir`'s
    generation_config.json (greedy without one), and the lines that say so (where the sampling
    came from; what the file asks for that is not applied, e.g. a repetition_penalty)."""
    from selfspec.checkpoint.generation import read_generation_config

    gen = read_generation_config(checkpoint_dir)
    model = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k}
    taken = {k: v for k, v in model.items() if kw.get(k) is None}
    out, lines = {**kw, **taken}, []
    if gen.source is not None and "temperature" in taken:
        lines.append(f"chat: sampling with {gen.describe()} from {gen.source} (--temperature 0 for greedy)"
                     if gen.sampled else f"chat: greedy ({gen.source} does not sample; --temperature T samples)")
    elif gen.source is not None and out["temperature"] > 0:  # the flag's temperature, the file's filters
        filters = ([f"top-p {taken['top_p']:g}"] if taken.get("top_p", 1.0) < 1.0 else []) + \
                  ([f"top-k {taken['top_k']}"] if taken.get("top_k") else [])
        if filters:
            lines.append(f"chat: {', '.join(filters)} from {gen.source}")
    note = gen.unsupported_note()
    return out, lines + ([f"chat: {note}"] if note else [])


def cmd_chat(a) -> int:
    from selfspec.checkpoint.registry import resolve
    from selfspec.loading import load
    from selfspec.engine.request.options import DecodeConfig
    from selfspec.tools.args import decode_kwargs

    from selfspec.checkpoint.synthetic import refuse

    refuse(a.model, "`selfspec chat`")  # before its minutes of building
    kw = decode_kwargs(a)
    DecodeConfig(**{**kw, **{k: v for k, v in SAMPLING.items() if kw[k] is None}})  # bad options fail before loading
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, device_map=a.device_map,
                      kv_cache_dtype=a.kv_cache_dtype)
    kw, lines = model_sampling(kw, resolve(a.model, progress=False))
    for line in lines:
        print(line, file=sys.stderr)
    return run_chat(model, tok, system=a.system, show_stats=a.stats, seed=a.seed, profile=a.profile, **kw)


def add_chat_parser(sub, add_common_args) -> None:
    c = sub.add_parser(
        "chat", help="talk to the model: streaming, multi-turn, with its chat template",
        description="Talk to the model. Sampling follows the model: --temperature, --top-p and --top-k win where "
                    "given; the others come from the checkpoint's generation_config.json as transformers reads it "
                    "(sampled only when it says do_sample; the default model's: temperature 0.2, top-p 0.9, its "
                    "card's recommendation), else greedy. --temperature 0 is greedy. The runtime has no repetition "
                    "penalty: a repetition_penalty in the file is reported at start and not applied. (`generate` "
                    "stays greedy unless --temperature is given.)")
    c.add_argument("--system", default=None, help="system prompt (default: the chat template's own)")
    c.add_argument("--stats", action="store_true", help="print tokens, tau and tok/s after each answer (stderr)")
    c.add_argument("--plan", default=None, choices=["auto", "fixed"])
    c.add_argument("--mode", default=None, choices=["auto", "ar", "linear", "presto", "lookup"])
    c.add_argument("--schedule", default=None, choices=["two-pass", "one-pass"],
                   help="--mode presto: unset = laid out per round for this device; named = that layout")
    c.add_argument("--budget", type=int, default=32, help="PRESTO draft nodes under the root (root excluded)")
    add_common_args(c)
    for action in c._actions:  # sampling: unset unless given, then the checkpoint's (cmd_chat)
        if action.dest in SAMPLING:
            action.default = None
            action.help = ((action.help + "; ") if action.help else "") + \
                "default: the checkpoint's generation_config.json, else off (greedy)"
    c.set_defaults(func=cmd_chat, max_new_tokens=512)
