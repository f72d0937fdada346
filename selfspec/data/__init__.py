"""Data shipped with selfspec: the bench's long-context suite (`long/`, see its README.md).

`long_suite_files()` finds the suite's files inside the installed package. `make_long_suite()`
rebuilt them from CPython 3.11's own files:

    python -c "from selfspec.data import make_long_suite; make_long_suite('/usr/lib/python3.11')"

Every text is from the Python 3.11 distribution (PSF License, `long/LICENSE-PSF.txt`): standard
library modules, and sections of the Language Reference / library docs as `pydoc_data/topics.py`
ships them. The instructions, questions and the assistant turns of the chats are written for this
suite (the project's Apache-2.0). Each text is cut at a line (code) or paragraph (prose) boundary so
that the whole prompt, as the default model's tokenizer encodes it (its chat template for
messages), is as close to 1,000 or 3,000 tokens as the boundaries allow. Four tasks per length, each
once per split ("tune": a planner may be tuned on it; "held-out": never), ordered tune, held-out.
"""

from __future__ import annotations

import json
import os
import re
from importlib import resources

LONG_LENGTHS = ("1k", "3k")  # the suite's files, long/<length>.jsonl; nominal prompt tokens 1,000 and 3,000
NOMINAL_TOKENS = {"1k": 1000, "3k": 3000}
SPLITS = ("tune", "held-out")


def long_suite_files() -> dict[str, str]:
    """{length: path} of the long-context suite's prompt files, found inside the installed package."""
    root = resources.files(__name__).joinpath("long")
    return {n: str(root.joinpath(f"{n}.jsonl")) for n in LONG_LENGTHS}



SYSTEM = "You are a careful Python expert. Answer precisely."
QUOTE = ("Answer the question from the document below only. Quote the sentences you rely on word for word, in "
         "double quotes, then give your answer in one short paragraph.\n\nQuestion: {q}\n\nDocument:\n\n{doc}")
SUMMARY = "Summarise the following section of the Python documentation in five bullet points.\n\n{doc}"
HINTS = ("Rewrite this module with type hints on every function and method signature. Keep the behaviour, the "
         "names and the docstrings unchanged.\n\n```python\n{doc}```")

# (id, task, split, kind, source, instruction/question); kind: code or topic (pydoc_data.topics)
TASKS = {
    "1k": [
        ("edit01", "edit", "tune", "raw", "textwrap.py", None),
        ("edit02", "edit", "held-out", "raw", "shlex.py", None),
        ("quote01", "quote", "tune", "topic", "try",
         "What happens to the name given after \"as\" in an except clause when the clause ends, and why?"),
        ("quote02", "quote", "held-out", "topic", "import",
         "What two steps does a basic import statement (one without a from clause) carry out?"),
        ("summary01", "summary", "tune", "topic", "assignment", None),
        ("summary02", "summary", "held-out", "topic", "comparisons", None),
        ("chat01", "chat", "tune", "chat", "bisect.py", None),
        ("chat02", "chat", "held-out", "chat", "fnmatch.py", None),
    ],
    "3k": [
        ("edit03", "edit", "tune", "hints", "json/decoder.py", None),
        ("edit04", "edit", "held-out", "hints", "json/encoder.py", None),
        ("quote03", "quote", "tune", "topic", "customization",
         "What must __init__() return, and what happens when __new__() does not return an instance of cls?"),
        ("quote04", "quote", "held-out", "topic", "attribute-access",
         "When is __getattr__() called, and how should __getattribute__() reach an attribute without recursing?"),
        ("summary03", "summary", "tune", "topic", "formatstrings", None),
        ("summary04", "summary", "held-out", "topic", "debugger", None),
        ("chat03", "chat", "tune", "chat", "heapq.py", None),
        ("chat04", "chat", "held-out", "chat", "contextlib.py", None),
    ],
}

# the chats' history: (first question, the assistant's answer, follow-up, its answer, last question)
CHATS = {
    "bisect.py": (
        "Here is a module from the standard library. What is the difference between bisect_left and bisect_right?",
        "Both return the index where x would be inserted to keep the list sorted. When x is already present, "
        "bisect_left returns the position before the existing equal items and bisect_right (also called bisect) "
        "the position after them. They differ only in the comparison inside the loop: `a[mid] < x` versus "
        "`x < a[mid]`.",
        "Why does every function check `lo < 0` and default `hi` to None?",
        "`lo` and `hi` bound the slice that is searched. A negative `lo` would index from the end, so it is "
        "refused with ValueError; `hi=None` means the whole list, and it is resolved to `len(a)` at call time so "
        "the default follows the list's current length.",
        "How would I use the key argument to keep a list of (priority, name) tuples sorted by priority only?",
    ),
    "fnmatch.py": (
        "I'm reading this module. Why are there two functions, fnmatch and fnmatchcase?",
        "fnmatch() first passes both the name and the pattern through os.path.normcase, so on Windows the match "
        "ignores case and treats slashes alike; on POSIX normcase does nothing. fnmatchcase() skips that step and "
        "always compares case-sensitively.",
        "What does translate() produce?",
        "A regular expression string equivalent to the shell pattern: `*` becomes `.*`, `?` becomes `.`, a "
        "bracket expression becomes a character class, and everything else is escaped. The result is anchored "
        "with `\\Z` and wrapped in `(?s:...)` so that the dot also matches newlines.",
        "Is the compiled pattern cached, and how large can that cache grow?",
    ),
    "heapq.py": (
        "Here is heapq from the standard library. Why does heappop move the last item to the root and then call "
        "_siftup?",
        "Removing the root leaves a hole. The last item is popped off the list, which is cheap, put at position 0, "
        "and _siftup restores the heap invariant. Unlike the textbook version, _siftup moves the smaller child up "
        "all the way to a leaf without comparing it with the new item, then calls _siftdown to bubble the item back "
        "into place; the long comment in the module explains why that needs fewer comparisons on average.",
        "What is the difference between heappushpop and heapreplace?",
        "heappushpop(heap, item) pushes first and then pops, so when item is smaller than the root it comes straight "
        "back and the heap is untouched. heapreplace(heap, item) pops first and then pushes, so it always returns "
        "the old root, even when item is smaller, and it raises IndexError on an empty heap.",
        "How does merge() stay lazy, and how would I use it to merge sorted log files by their timestamps?",
    ),
    "contextlib.py": (
        "I'm reading contextlib.py. How does @contextmanager turn a generator into a context manager?",
        "contextmanager wraps the generator function in a helper that returns a _GeneratorContextManager. Its "
        "__enter__ calls next() on the generator and returns the value it yields. Its __exit__ calls next() again "
        "when the block ended normally, expecting StopIteration, or throws the exception into the generator at the "
        "yield with gen.throw(), so a try/finally around the yield runs the cleanup either way.",
        "What happens if the generator yields twice?",
        "After a normal exit __exit__ expects the generator to stop; if it yields again, __exit__ raises "
        "RuntimeError(\"generator didn't stop\"). If an exception was thrown in and the generator catches it and "
        "yields again, the error is \"generator didn't stop after throw()\".",
        "When should I use ExitStack instead of nesting with statements?",
    ),
}


def _tokens(tok, prompt) -> int:
    from selfspec.streaming import encode_prompt

    return len(encode_prompt(tok, prompt))


def _cuts(text: str, kind: str) -> list[int]:
    """Candidate end offsets: after each line (code) or each paragraph (prose)."""
    sep = "\n" if kind == "code" else "\n\n"
    return [m.end() for m in re.finditer(re.escape(sep), text)] + [len(text)]


def _fit(tok, text: str, kind: str, build, target: int) -> tuple[object, int]:
    """The prompt `build(text[:cut])` whose token count is nearest `target` (binary search on cuts)."""
    best, n = _nearest(tok, text, _cuts(text, kind), build, target)
    if abs(n - target) > 0.05 * target and kind != "code":  # a long paragraph: cut at a line instead
        best, n = _nearest(tok, text, _cuts(text, "code"), build, target)
    if abs(n - target) > 0.05 * target:
        raise SystemExit(f"cannot cut near {target} tokens: nearest is {n}")
    return best, n


def _nearest(tok, text: str, cuts: list[int], build, target: int) -> tuple[object, int]:
    lo, hi = 0, len(cuts) - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _tokens(tok, build(text[: cuts[mid]])) <= target:
            lo = mid
        else:
            hi = mid - 1
    best = min((build(text[: cuts[i]]) for i in {lo, min(lo + 1, len(cuts) - 1)}),
               key=lambda p: abs(_tokens(tok, p) - target))
    return best, _tokens(tok, best)


def build_suite(lib: str, tok) -> dict[str, list[dict]]:
    from pydoc_data.topics import topics

    out = {}
    for length, tasks in TASKS.items():
        target = {"1k": 1000, "3k": 3000}[length]
        recs = []
        for pid, task, split, kind, src, q in tasks:
            if kind == "topic":
                text, cut = topics[src], "prose"
            else:
                with open(os.path.join(lib, src), encoding="utf-8") as f:
                    text, cut = f.read(), "code"
            if kind == "raw":  # continue this code: the file's head as a plain prompt
                build = lambda d: d  # noqa: E731
            elif kind == "hints":
                build = lambda d: [{"role": "user", "content": HINTS.format(doc=d)}]  # noqa: E731
            elif kind == "topic" and task == "quote":
                build = lambda d, q=q: [{"role": "user", "content": QUOTE.format(q=q, doc=d.rstrip())}]  # noqa: E731
            elif kind == "topic":
                build = lambda d: [{"role": "user", "content": SUMMARY.format(doc=d.rstrip())}]  # noqa: E731
            else:
                q1, a1, q2, a2, q3 = CHATS[src]
                build = lambda d, q1=q1, a1=a1, q2=q2, a2=a2, q3=q3, src=src: [  # noqa: E731
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"{q1}\n\n```python\n# {src}\n{d}```"},
                    {"role": "assistant", "content": a1}, {"role": "user", "content": q2},
                    {"role": "assistant", "content": a2}, {"role": "user", "content": q3}]
            prompt, n = _fit(tok, text, cut, build, target)
            source = f"CPython 3.11 Lib/{src}" if kind != "topic" else f"CPython 3.11 docs, pydoc topic {src!r}"
            rec = {"id": pid, "split": split, "task": task, "length": length, "tokens": n, "source": source}
            rec["messages" if isinstance(prompt, list) else "prompt"] = prompt
            recs.append(rec)
        out[length] = recs
    return out


def make_long_suite(lib: str = "/usr/lib/python3.11") -> dict[str, list[dict]]:
    """Rebuild long/1k.jsonl and long/3k.jsonl from CPython 3.11's `lib` folder (and this
    interpreter's pydoc topics), measured with the default model's tokenizer; returns the records."""
    import selfspec

    _, tok = selfspec.load(progress=False)
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "long")
    suite = build_suite(lib, tok)
    for length, recs in suite.items():
        with open(os.path.join(here, f"{length}.jsonl"), "w", encoding="utf-8") as f:
            for r in recs:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    return suite
