"""Comments say why; figures live on the results page (`docs/results.md`): no measured timing,
rate or ratio (`36.4 s`, `3 ms`, `19.7 tok/s`, `0.86x`) in a comment or docstring of `selfspec/`.

A figure stales the day the code around it moves. Worked examples are allowed: a docstring
paragraph that starts with "Example" may price things in ms to show the arithmetic. Constants
and code are not read (only comments and docstrings), so `1e-3` or a unit in an f-string is fine.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "selfspec"

FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:-\d+(?:\.\d+)?)? ?(?:ms|us|µs|s|tok/s|tokens/s)\b"
                    r"|(?<![\w.])\d+\.\d+(?:-\d+\.\d+)? ?x\b")


def _docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                yield body[0].value.lineno, body[0].value.value


def figures(text: str, name: str = "<text>") -> list[str]:
    """`name:line: the figure` for each measured figure in the comments and docstrings of `text`."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            found += [f"{name}:{tok.start[0]}: {m.group(0)}" for m in FIGURE.finditer(tok.string)]
    for line, doc in _docstrings(ast.parse(text)):
        start = 0
        for para in re.split(r"(\n\s*\n)", doc):
            if not para.strip().startswith("Example"):  # a worked example's units are no measurement
                found += [f"{name}:{line + doc[:start + m.start()].count(chr(10))}: {m.group(0)}"
                          for m in FIGURE.finditer(para)]
            start += len(para)
    return found


def test_no_measured_figures_in_comments_or_docstrings():
    found = [f for path in sorted(ROOT.rglob("*.py"))
             for f in figures(path.read_text(), str(path.relative_to(ROOT.parent)))]
    assert found == [], "measured figures belong on docs/results.md:\n" + "\n".join(found)


def test_the_check_finds_figures_and_leaves_examples_and_code_alone():
    text = '''"""A module.

Took 36.4 s against 21.0 s before.

Example: a round of 10 ms and a chunk of 3 ms.
"""
X = 1e-3  # seconds a token at 0.86x AR
label = f"{X} ms"


def f():
    """Three pieces (1,024 tokens: 11.5 s); 19.7 tok/s; 2-4.5% slower at 1.2-1.35x."""
'''
    got = [f.split(": ", 1)[1] for f in figures(text)]
    assert got == ["0.86x", "36.4 s", "21.0 s", "11.5 s", "19.7 tok/s", "1.2-1.35x"]
