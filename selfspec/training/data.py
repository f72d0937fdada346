"""The shipped model's corpus: the running interpreter's standard library sources.

Held-out rule (never trained on): a file is held out when the first byte of
sha1(relative path, '/'-separated, UTF-8) is below 26, i.e. about 10% of files, stable across
machines for the same Python version. The evaluation prompts come only from held-out files.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
from pathlib import Path

HELD_OUT_BELOW = 26  # first sha1 byte < 26  ->  ~10.2% of files


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    return hashlib.sha1(relpath.replace(os.sep, "/").encode()).digest()[0] < HELD_OUT_BELOW


def corpus_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib .py file, sorted, site-packages excluded."""
    root = Path(root or stdlib_root())
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        out.append((rel, p))
    if not out:
        raise FileNotFoundError(f"no .py files under {root}")
    return out


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def split_corpus(root: Path | None = None) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(train, held_out) lists of (relpath, text)."""
    train, held = [], []
    for rel, p in corpus_files(root):
        text = read_text(p)
        if text is None or not text.strip():
            continue
        (held if is_held_out(rel) else train).append((rel, text))
    return train, held


def function_prompts(held_out: list[tuple[str, str]], *, limit: int = 64, head_lines: int = 2) -> list[dict]:
    """Prompts from held-out files: a function's source cut after its signature and first lines.

    Rule: walk held-out files in sorted order; take each top-level or method `def` whose body has
    at least 6 lines and whose source is 200-4000 characters; the prompt is the `def` line(s)
    through the end of the signature plus the next `head_lines` body lines (docstring lines
    included); at most 2 functions per file; stop at `limit`.
    """
    prompts = []
    for rel, text in held_out:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        taken = 0
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or taken >= 2:
                continue
            start = node.lineno - 1
            body_start = node.body[0].lineno - 1
            end = node.end_lineno or body_start
            src = "".join(lines[start:end])
            if end - body_start < 6 or not 200 <= len(src) <= 4000:
                continue
            cut = min(body_start + head_lines, end)
            prompt = "".join(lines[start:cut])
            prompts.append({"id": f"{rel}:{node.lineno}", "prompt": prompt})
            taken += 1
            if len(prompts) >= limit:
                return prompts
    return prompts


def write_jsonl(rows: list[dict], path: str | os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def main(argv=None) -> None:
    """python -m selfspec.training.data --prompts OUT.jsonl [--limit N]: write the held-out prompt set."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m selfspec.training.data", description=main.__doc__)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int, default=64)
    a = ap.parse_args(argv)
    _, held = split_corpus()
    rows = function_prompts(held, limit=a.limit)
    write_jsonl(rows, a.prompts)
    print(f"{len(rows)} prompts from {len(held)} held-out files -> {a.prompts}")


if __name__ == "__main__":
    main()
