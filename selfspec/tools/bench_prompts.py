"""The bench's prompts: a JSONL prompt file, or a suite shipped with the package (`selfspec/data`)."""

from __future__ import annotations

import json
import os
import sys

META = ("split", "task", "length")  # a prompt's fields the records keep (the long suite's)
SPLITS = ("tune", "held-out")


def read_prompts(path: str) -> list[dict]:
    """JSONL with {"prompt": str} or {"messages": [...]} per line; every bad line is reported."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompt file {path} not found")
    rows, errors = [], []
    with open(path, encoding="utf-8") as f:
        for no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                errors.append(f"line {no}: not JSON ({e.msg})")
                continue
            if not isinstance(rec, dict):
                errors.append(f"line {no}: expected an object")
            elif "split" in rec and rec["split"] not in SPLITS:
                errors.append(f"line {no}: 'split' must be one of {SPLITS}, got {rec['split']!r}")
            elif not (body := _body(rec)):
                errors.append(f"line {no}: needs a non-empty 'prompt' string or 'messages' list")
            else:
                rows.append({"id": rec.get("id", f"line{no}"), "prompt": body, **{k: rec[k] for k in META if k in rec}})
    if errors:
        raise ValueError(f"{path}: " + "; ".join(errors[:10]) + (f" (+{len(errors) - 10} more)" if len(errors) > 10 else ""))
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _body(rec: dict):
    """The record's prompt: a non-empty string, else a non-empty messages list, else None."""
    if isinstance(rec.get("prompt"), str) and rec["prompt"]:
        return rec["prompt"]
    if isinstance(rec.get("messages"), list) and rec["messages"]:
        return rec["messages"]
    return None


def read_suite(name: str, limit: int = 0) -> list[dict]:
    """A shipped suite's prompts (`selfspec/data`): "long" is 1k.jsonl then 3k.jsonl, each prompt
    tagged with its length; `limit` N keeps the first N prompts of each length (0: all)."""
    from selfspec.data import long_suite_files

    if name != "long":
        raise ValueError(f"unknown suite {name!r}; expected 'long'")
    out = []
    for length, path in long_suite_files().items():
        rows = [{**p, "length": length} for p in read_prompts(path)]
        out += rows[:limit] if limit else rows
    return out


def bench_prompts(path: str | None, model_dir: str) -> tuple[str, list[dict]]:
    """(the prompt file, its prompts) for a decode grid: `path`, or the model's prompts.jsonl. A
    synthetic model (`synthetic:nld-3b`: random weights, no folder) takes the shipped model's
    file by default and drops chat prompts, saying so once: its tokenizer has no chat template."""
    from selfspec.checkpoint.model import default_model_dir
    from selfspec.checkpoint.synthetic import is_synthetic

    if not is_synthetic(model_dir):
        path = path or os.path.join(model_dir, "prompts.jsonl")
        return path, read_prompts(path)
    path = path or os.path.join(default_model_dir(), "prompts.jsonl")
    rows = read_prompts(path)
    plain = [r for r in rows if isinstance(r["prompt"], str)]
    if not plain:
        raise ValueError(f"{path}: {model_dir} takes plain-text prompts ('prompt'), and every prompt here is a chat")
    if len(plain) < len(rows):
        print(f"bench: {model_dir}: {len(rows) - len(plain)} chat prompts of {path} skipped (a synthetic model has "
              f"no chat template)", file=sys.stderr)
    return path, plain

