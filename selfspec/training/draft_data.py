"""Text windows for the draft-LoRA distillation (`selfspec.training.draft_lora`).

Two kinds of window, both from the interpreter's standard library (`selfspec.training.data`):
* code: a random training file from a random line on, `window` tokens of it;
* chat: ChatML conversations (the tokenizer's own chat template, its default system prompt
  included) made from stdlib functions, packed until `window` tokens:
  - "Write a Python function `name(sig)` that <first docstring sentence>" -> the source;
  - "What does this Python function do?" + the source without its docstring -> the docstring;
  - "What is the `<module>` module for?" -> the module docstring.
Training draws only non-held-out files (`data.is_held_out`); the validation set only held-out
ones. `models/*/prompts.jsonl` is never read here. A window is a pure function of (seed, step),
so a resumed run sees the same data as an uninterrupted one.
"""

from __future__ import annotations

import ast
import json
import random
import re
import textwrap
from functools import lru_cache

from selfspec.training.data import corpus_files, is_held_out, read_text


@lru_cache(maxsize=2)
def files(held_out: bool) -> tuple:
    return tuple(p for rel, p in corpus_files() if is_held_out(rel) == held_out)


@lru_cache(maxsize=256)
def _functions(path) -> tuple:
    """(name, signature line(s), full source, docstring, source without docstring) per documented function."""
    text = read_text(path)
    if not text:
        return ()
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return ()
    lines = text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        end = node.end_lineno or node.lineno
        if not doc or len(doc) < 20 or end - node.lineno > 60:
            continue
        start = node.lineno - 1 - len(node.decorator_list)
        src = textwrap.dedent("".join(lines[start:end]))
        d0, d1 = node.body[0].lineno - 1, node.body[0].end_lineno
        bare = textwrap.dedent("".join(lines[start:d0] + lines[d1:end]))
        sig = textwrap.dedent("".join(lines[node.lineno - 1:node.body[0].lineno - 1])).strip() or f"def {node.name}(...)"
        out.append((node.name, sig.rstrip(":"), src, doc, bare))
        if len(out) >= 40:
            break
    return tuple(out)


def _module_doc(path) -> str | None:
    text = read_text(path)
    try:
        return ast.get_docstring(ast.parse(text)) if text else None
    except (SyntaxError, ValueError):
        return None


def conversation(rng: random.Random, pool) -> list[dict] | None:
    path = rng.choice(pool)
    kind = rng.random()
    if kind < 0.15:
        doc = _module_doc(path)
        if not doc or len(doc) < 40:
            return None
        return [{"role": "user", "content": f"What is the `{path.stem}` module for?"},
                {"role": "assistant", "content": doc[:1500]}]
    fns = _functions(path)
    if not fns:
        return None
    name, sig, src, doc, bare = rng.choice(fns)
    first = re.split(r"(?<=\.)\s", doc.strip(), maxsplit=1)[0].strip()
    if kind < 0.6:
        ask = rng.choice(["Write a Python function `{s}` that {d}", "Implement `{s}` in Python: {d}",
                          "Can you write `{s}`? It should do this: {d}"])
        lead = rng.choice(["", "Here is an implementation:\n\n", "Sure:\n\n"])
        return [{"role": "user", "content": ask.format(s=sig, d=first[:1].lower() + first[1:])},
                {"role": "assistant", "content": f"{lead}```python\n{src.rstrip()}\n```"}]
    ask = rng.choice(["What does this Python function do?", "Explain this code:", "Describe what `{n}` does."])
    return [{"role": "user", "content": ask.format(n=name) + f"\n\n```python\n{bare.rstrip()}\n```"},
            {"role": "assistant", "content": doc}]


def chat_window(tok, rng: random.Random, pool, window: int) -> list[int]:
    ids: list[int] = []
    for _ in range(200):
        if len(ids) >= window:
            break
        msgs = conversation(rng, pool)
        if msgs:
            ids += tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    return ids[:window]


def code_window(tok, rng: random.Random, pool, window: int) -> list[int]:
    ids: list[int] = []
    for _ in range(50):
        if len(ids) >= window:
            break
        text = read_text(rng.choice(pool)) or ""
        lines = text.splitlines(keepends=True)
        if not lines:
            continue
        start = rng.randrange(max(1, len(lines) - 20)) if not ids else 0
        ids += tok("".join(lines[start:])[: window * 8], add_special_tokens=False)["input_ids"]
    return ids[:window]


@lru_cache(maxsize=2)
def greedy_records(path: str) -> tuple:
    """The id lists of a `greedy_data` JSONL file (the model's own greedy answers with their prompts)."""
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(tuple(json.loads(line)["ids"]))
            except (ValueError, KeyError):
                break  # a torn last line from an interrupted writer
    if not out:
        raise ValueError(f"{path}: no greedy-answer records")
    return tuple(out)


def greedy_window(rng: random.Random, records, window: int) -> list[int]:
    """Records packed from a random point of a random one on, `window` tokens."""
    rec = rng.choice(records)
    ids = list(rec[rng.randrange(max(1, len(rec) - window // 2)):])
    while len(ids) < window:
        ids += rng.choice(records)
    return ids[:window]


def train_window(tok, seed: int, step: int, window: int, p_chat: float = 0.5, greedy: str | None = None,
                 p_greedy: float = 0.0) -> tuple[list[int], random.Random]:
    """The step's window and the RNG the step goes on with (anchors): a function of (seed, step) and
    the greedy file's contents. With `greedy` (a `greedy_data` file) a share `p_greedy` of windows
    is the model's own greedy text; without it the stream is what it always was."""
    rng = random.Random(seed * 1_000_003 + step)
    if greedy and p_greedy > 0 and rng.random() < p_greedy:
        return greedy_window(rng, greedy_records(greedy), window), rng
    pool = files(False)
    if rng.random() < p_chat:
        return chat_window(tok, rng, pool, window), rng
    return code_window(tok, rng, pool, window), rng


def validation_windows(tok, window: int, n_code: int = 8, n_chat: int = 4) -> list[tuple[str, list[int]]]:
    """Fixed held-out windows: ("code"|"chat", ids)."""
    rng = random.Random(1234)
    pool = files(True)
    out = [("code", code_window(tok, rng, pool, window)) for _ in range(n_code)]
    out += [("chat", chat_window(tok, rng, pool, window)) for _ in range(n_chat)]
    return [(k, ids) for k, ids in out if len(ids) == window]
