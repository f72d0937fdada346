"""Every repository path that README.md and docs/*.md name exists in the checkout.

Checked: markdown links and images with a relative target (resolved from the page's folder, as
GitHub does) and, inside backticks (inline or fenced), paths that start with one of the
repository's top-level folders. Not checked: URLs and anchors, git object names
(`git show <commit>:docs/...`), globs and placeholders (`docs/results/*/results.json`,
`models/<name>/`), and anything that does not start with a top-level folder
(`path/to/checkpoint`, `runs/...`).
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOP = ("docs", "benchmarks", "examples", "selfspec", "models", "tests")
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCED = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1", re.S | re.M)
INLINE = re.compile(r"(`+)(.+?)\1", re.S)
# a top-level folder, not glued to what precedes it (a word, another path, a `commit:`, a URL)
REPO_PATH = re.compile(r"(?<![\w./:@~$%%-])((?:%s)/[\w./+-]*)" % "|".join(TOP))
PLACEHOLDER = set("<>*?[]{}$%|")


def code_spans(text: str) -> list[str]:
    spans = [m.group(2) for m in FENCED.finditer(text)]
    rest = FENCED.sub("", text)
    return spans + [m.group(2) for m in INLINE.finditer(rest)]


def repo_paths(span: str) -> list[str]:
    out = []
    for m in REPO_PATH.finditer(span):
        nxt = span[m.end():m.end() + 1]
        if nxt and nxt in PLACEHOLDER or "..." in m.group(1):
            continue  # a glob or a placeholder: models/<name>/, docs/results/*/results.json
        out.append(m.group(1).rstrip(".,;:"))
    return out


def link_targets(text: str) -> list[str]:
    out = []
    for target in LINK.findall(FENCED.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
            continue  # a URL, mailto:, an anchor on the same page, a site-absolute link
        target = target.split("#", 1)[0].split("?", 1)[0]
        if target and not set(target) & PLACEHOLDER:
            out.append(target)
    return out


def named_paths(page: Path) -> list[tuple[str, Path]]:
    """(as written, resolved) for every repository path the page names."""
    text = page.read_text(encoding="utf-8")
    named = [(t, (page.parent / t).resolve()) for t in link_targets(text)]
    named += [(p, ROOT / p) for span in code_spans(text) for p in repo_paths(span)]
    return named


def test_the_pages_exist_and_name_paths():
    assert (ROOT / "README.md").is_file() and len(PAGES) > 3
    assert sum(len(named_paths(p)) for p in PAGES) > 50  # the extraction finds what the pages cite


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_path_a_page_names_exists(page):
    missing = sorted({written for written, path in named_paths(page) if not path.exists()})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_the_extraction_keeps_paths_and_skips_urls_globs_placeholders_and_git_objects():
    text = ("See `benchmarks/formats.py --out docs/results/wave4/formats.json` and [a](docs/x.md), "
            "![p](results/a.png), [u](https://example.com/docs/y.md), [s](#top), `git show abc123:docs/old.md`, "
            "`docs/results/*/results.json`, `models/<name>/`, `path/to/checkpoint`, `runs/x`, "
            "`docs/results/<path>`, `selfspec/foo.py`.\n```bash\npython examples/run.py\n```\n")
    spans = code_spans(text)
    assert [p for s in spans for p in repo_paths(s)] == [
        "examples/run.py", "benchmarks/formats.py", "docs/results/wave4/formats.json", "selfspec/foo.py"]
    assert link_targets(text) == ["docs/x.md", "results/a.png"]
