"""The budgets the project holds (issue 76): a results page of current tables and the data behind
them only, a README for users, and benchmarks/ holding checks against other engines and devices,
each of which answers --help without starting work."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
MAX_RESULT_FILES, MAX_RESULT_BYTES = 20, 2_000_000
MAX_RESULTS_LINES, MAX_README_LINES, MAX_BENCHMARK_FILES = 300, 250, 8


def result_files() -> list[Path]:
    return [p for p in (ROOT / "docs/results").rglob("*") if p.is_file()]


def test_docs_results_holds_at_most_20_files_and_2_mb():
    files = result_files()
    assert len(files) <= MAX_RESULT_FILES, f"docs/results/ holds {len(files)} files (budget {MAX_RESULT_FILES})"
    size = sum(p.stat().st_size for p in files)
    assert size <= MAX_RESULT_BYTES, f"docs/results/ holds {size} bytes (budget {MAX_RESULT_BYTES})"


def test_every_file_in_docs_results_is_data_behind_a_table_of_the_page():
    page = (ROOT / "docs/results.md").read_text(encoding="utf-8")
    unused = [str(p.relative_to(ROOT)) for p in result_files() if str(p.relative_to(ROOT)) not in page]
    assert not unused, f"docs/results.md cites none of {unused}: keep only the data behind its tables"


@pytest.mark.parametrize("page, budget", [("docs/results.md", MAX_RESULTS_LINES), ("README.md", MAX_README_LINES)])
def test_page_length_budget(page, budget):
    n = len((ROOT / page).read_text(encoding="utf-8").splitlines())
    assert n <= budget, f"{page} has {n} lines (budget {budget})"


@pytest.mark.parametrize("page", ["docs/results.md", "docs/log.md", "README.md"])
def test_no_page_is_ordered_by_work_sessions(page):
    heads = [h for h in (ROOT / page).read_text(encoding="utf-8").splitlines() if h.startswith("#")]
    assert not [h for h in heads if "session" in h.lower()], f"{page}: a heading names a session"


def test_every_results_section_names_a_commit_a_date_and_a_command():
    text = (ROOT / "docs/results.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    for sec in sections:
        title = sec.splitlines()[0]
        if title == "Machines":
            continue
        assert re.search(r"`[0-9a-f]{7,40}`", sec), f"section {title!r} names no commit"
        assert re.search(r"20\d\d-\d\d-\d\d", sec), f"section {title!r} names no date"
        assert re.search(r"python -m selfspec|run as:|bash benchmarks/", sec), f"section {title!r} names no command"


def test_the_log_keeps_short_dated_entries_each_with_its_commit():
    text = (ROOT / "docs/log.md").read_text(encoding="utf-8")
    entries = re.split(r"^## ", text, flags=re.M)[1:]
    assert entries
    for e in entries:
        lines = e.splitlines()
        assert re.match(r"20\d\d-\d\d-\d\d: ", lines[0]), f"log entry without a date: {lines[0]!r}"
        assert re.search(r"`[0-9a-f]{7,40}`", lines[0]), f"log entry without its commit: {lines[0]!r}"
        assert len([x for x in lines[1:] if x.strip()]) <= 15, f"log entry over 15 lines: {lines[0]!r}"


def benchmark_files() -> list[Path]:
    return sorted(p for p in BENCHMARKS.iterdir() if p.is_file())


def test_benchmarks_holds_at_most_8_files_all_scripts():
    files = benchmark_files()
    assert len(files) <= MAX_BENCHMARK_FILES, f"benchmarks/ holds {len(files)} files (budget {MAX_BENCHMARK_FILES})"
    assert all(p.suffix in (".py", ".sh") for p in files), [p.name for p in files if p.suffix not in (".py", ".sh")]


def help_runs(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    """`script --help` in an empty folder, with no GPU and a throwaway cache: what it prints and leaves."""
    cmd = ["bash", str(script)] if script.suffix == ".sh" else [sys.executable, str(script)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "SELFSPEC_CACHE": str(tmp_path / "cache"),
           "SCRATCH": str(tmp_path / "scratch"), "OUT": str(tmp_path / "out")}
    # its own process group: a script that starts work anyway is stopped with everything it spawned
    p = subprocess.Popen(cmd + ["--help"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return subprocess.CompletedProcess(p.args, -9, out, err + "\n(still running after 60 s: killed)")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize("script", benchmark_files(), ids=lambda p: p.name)
def test_every_benchmark_script_answers_help_without_starting_work(script, tmp_path):
    r = help_runs(script, tmp_path)
    assert r.returncode == 0, f"{script.name} --help exited {r.returncode}: {r.stderr[-500:]}"
    assert len(r.stdout.strip().splitlines()) >= 2, f"{script.name} --help printed no usage"
    assert sorted(os.listdir(tmp_path)) == [], f"{script.name} --help wrote {os.listdir(tmp_path)}"


def test_the_help_check_fails_a_script_that_starts_work_on_help(tmp_path):
    script = tmp_path / "bad.sh"
    script.write_text("#!/usr/bin/env bash\nmkdir -p \"$OUT\"\necho started > \"$OUT/log\"\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    r = help_runs(script, run_dir)
    assert r.returncode != 0 or len(r.stdout.strip().splitlines()) < 2 or os.listdir(run_dir)
