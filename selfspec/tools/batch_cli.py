"""`python -m selfspec generate --prompt-file prompts.jsonl --batch-size 8 [--json]`: many prompts at once.

The prompt file holds one prompt per line, as JSON: a string, or an object with "prompt" (text)
or "messages" (chat messages). Output, in input order once the batch is done: with --json one
JSON record per prompt (index, text, token_ids, finish_reason and the row's stats), else each
row's text followed by a newline.
"""

from __future__ import annotations

import json
import sys

from selfspec.tools.args import check_profile_arg, decode_kwargs


def read_jsonl_prompts(name: str) -> list:
    try:
        with open(name, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except FileNotFoundError:
        raise FileNotFoundError(f"prompt file {name} not found") from None
    except (IsADirectoryError, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"prompt file {name} cannot be read: {e}") from None
    prompts = []
    for i, ln in enumerate(lines, 1):
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError as e:
            raise ValueError(f"prompt file {name} line {i}: not JSON ({e.msg})") from None
        if isinstance(rec, dict):
            rec = rec.get("prompt", rec.get("messages"))
        if not (isinstance(rec, str) or (isinstance(rec, list) and rec and all(isinstance(m, dict) for m in rec))):
            raise ValueError(f"prompt file {name} line {i}: expected a string or an object with 'prompt' or 'messages'")
        if not rec:
            raise ValueError(f"prompt file {name} line {i}: empty prompt")
        prompts.append(rec)
    if not prompts:
        raise ValueError(f"prompt file {name} holds no prompts")
    return prompts


def cmd_generate_batch(a) -> int:
    from selfspec.loading import load
    from selfspec.engine.request.options import DecodeConfig
    from selfspec.streaming import generate

    cfg = DecodeConfig(**decode_kwargs(a))  # bad options fail before the model loads
    if a.prompt_file is None:
        raise ValueError("--batch-size needs --prompt-file (JSON lines, one prompt per line)")
    if a.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {a.batch_size}")
    if a.stop and not all(a.stop):
        raise ValueError("stop strings must be non-empty")
    check_profile_arg(a, cfg)
    prompts = read_jsonl_prompts(a.prompt_file)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model, tok = load(a.model, weights=a.weights, dtype=a.dtype, device=a.device, device_map=a.device_map,
                      kv_cache_dtype=a.kv_cache_dtype)
    results = generate(model, tok, prompts, seed=a.seed, batch_size=a.batch_size, profile=a.profile,
                       stop=a.stop or None, **decode_kwargs(a))
    for i, r in enumerate(results):
        if a.json:
            print(json.dumps({"index": i, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                              **r.stats.as_dict()}))
        else:
            print(r.text)
    if not a.json:
        n = sum(r.stats.new_tokens for r in results)
        print(f"[batch {a.batch_size}] {len(results)} prompts, {n} tokens", file=sys.stderr)
    return 0
