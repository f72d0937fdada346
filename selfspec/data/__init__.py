"""Data shipped with selfspec: the bench's long-context suite (`long/`, see its README.md)."""

from __future__ import annotations

from importlib import resources

LONG_LENGTHS = ("1k", "3k")  # the suite's files, long/<length>.jsonl; nominal prompt tokens 1,000 and 3,000
NOMINAL_TOKENS = {"1k": 1000, "3k": 3000}
SPLITS = ("tune", "held-out")


def long_suite_files() -> dict[str, str]:
    """{length: path} of the long-context suite's prompt files, found inside the installed package."""
    root = resources.files(__name__).joinpath("long")
    return {n: str(root.joinpath(f"{n}.jsonl")) for n in LONG_LENGTHS}
