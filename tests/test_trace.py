"""Per-round traces: the hook's records agree with the run, and the HTML page shows exactly them.

The page is parsed with the standard library's html.parser: one tree per round, as many nodes
as the verified tree, the highlighted path is the walk's path, the committed spans concatenate
to the generated text, and hostile token text stays text.
"""

import os
import re
import unicodedata
from html.parser import HTMLParser

import pytest
import torch

from selfspec.tools.cli import main
from selfspec.streaming import generate
from selfspec.trace import Trace, split_scores
from selfspec.trace_html import esc, short, tree_rows, visible
from selfspec.drafting.sampling import walk

from conftest import SHIPPED, tiny_config, tiny_model

HOSTILE = ["<script>alert(1)</script>", "&amp;", '"', "'", "\x00", "\x1b[2J", "</svg>", "<!--", "]]>",
           "<img src=x onerror=alert(2)>", "\u0085", "a\rb", " x", "\n", "&#60;", "</pre>"]


class PieceTokenizer:
    """ids 0-4 are specials (decode to nothing); id i >= 5 is the piece PIECES[i % len(PIECES)]."""

    eos_token_id = 2
    chat_template = None

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=True, **_):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return "".join(self.pieces[i % len(self.pieces)] for i in ids if i >= 5)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread (conftest)


TOK = PieceTokenizer(["a", "b", " c", "\n", "de", "f("])


class Page(HTMLParser):
    """What the tests read from a trace page."""

    def __init__(self, text):
        super().__init__(convert_charrefs=True)
        self.tags, self.trees, self.spans, self.open_rounds, self.folded_rows = [], [], [], 0, 0
        self._span = self._tree = self._label = None
        self._in_title = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = (a.get("class") or "").split()
        self.tags.append(tag)
        self._in_title = self._in_title or tag == "title"
        if tag == "svg" and "tree" in cls:
            self._tree = {"round": int(a["data-round"]), "nodes": [], "accepted": [], "target": ""}
            self.trees.append(self._tree)
        elif tag == "g" and "n" in cls and self._tree is not None:
            self._tree["nodes"].append(int(a["data-node"]))
            if "a" in cls:
                self._tree["accepted"].append(int(a["data-node"]))
        elif tag == "g" and "t" in cls and self._tree is not None:
            self._label = "target"
        elif tag == "a" and "c" in cls:
            self._span = [a["data-round"], ""]
            self.spans.append(self._span)
        elif tag == "details" and "round" in cls and "open" in a:
            self.open_rounds += 1
        elif tag == "tr" and a.get("id", "").startswith("r"):
            self.folded_rows += 1

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        elif tag == "svg":
            self._tree = None
        elif tag == "a":
            self._span = None
        elif tag == "g":
            self._label = None

    def handle_data(self, data):
        if self._span is not None:
            self._span[1] += data
        if self._label == "target" and self._tree is not None and not self._in_title:
            self._tree["target"] += data

    def handle_startendtag(self, tag, attrs):
        self.tags.append(tag)


def _run(model, prompt_ids, tok=TOK, **kw):
    """Run with trace=True while keeping every raw hook dict (tree, targets) for independent checks."""
    from selfspec.streaming import stream

    gen = stream(model, tok, prompt_ids, trace=True, **kw)
    raw, record = [], gen.decoder.on_round

    def both(info):
        raw.append(info)
        record(info)

    gen.decoder.on_round = both
    for _ in gen:
        pass
    return gen, raw


SETTINGS = [dict(mode="presto", schedule="one-pass", budget=8, block_length=6),
            dict(mode="presto", schedule="two-pass", budget=5, block_length=4, rho="none", lam=0.0),
            dict(mode="linear", schedule="one-pass", block_length=4),
            dict(mode="ar")]


@pytest.fixture(scope="module", params=SETTINGS, ids=["presto-1p", "presto-2p", "linear-1p", "ar"])
def run(request):
    """One traced generation per setting (no eos: every round runs), with the raw hook dicts."""
    return _run(tiny_model(), [5, 6, 7, 8], max_new_tokens=24, eos_token_id=[], **request.param)


def test_page_draws_one_tree_per_round_with_the_walk_path_highlighted(run):
    gen, raw = run
    page = Page(gen.trace.to_html(open_rounds=3))
    assert gen.stats.rounds == len(raw) == len(page.trees) > 1
    emitted = gen.token_ids[1:]
    for info, tree in zip(raw, page.trees):
        t = info["tree"]
        path, bonus = walk(t, info["targets"])  # recomputed here, not taken from the hook
        assert tree["round"] == info["round"]
        assert tree["nodes"] == list(range(len(t)))
        assert tree["accepted"] == path
        assert tree["target"] == short(TOK.decode([bonus]) or f"#{bonus}")
        said = t.tokens[path[1:]].tolist() + [bonus]
        assert emitted[: len(said)] == said  # the highlighted path is what the run emitted
        emitted = emitted[len(said):]
    assert emitted == []
    assert page.open_rounds == 3


def test_committed_spans_concatenate_to_the_generated_text(run):
    gen, _ = run
    page = Page(gen.trace.to_html())
    assert [s[0] for s in page.spans] == ["prefill"] + [str(i) for i in range(gen.stats.rounds)]
    assert "".join(s[1] for s in page.spans) == visible(gen.text)
    chunks = gen.trace.token_chunks
    assert [len(c) for c in chunks[1:]] == gen.stats.accept_lengths
    for (_, text), chunk in zip(page.spans[1:], chunks[1:]):
        assert text == TOK.decode(chunk)  # one round's span is that round's tokens


class ByteTokenizer:
    """id i >= 5 is the byte i - 5; broken UTF-8 decodes to U+FFFD (like byte-fallback tokenizers)."""

    def decode(self, ids, skip_special_tokens=True, **_):
        return bytes(i - 5 for i in ids if i >= 5).decode("utf-8", errors="replace")


def test_spans_never_split_a_character_and_keep_an_unfinished_tail():
    a, e1, e2 = ord("a") + 5, 0xC3 + 5, 0xA9 + 5  # "é" is C3 A9
    tr = Trace(ByteTokenizer(), [a])
    tr.chunks = [[a], [e1], [e2, a]]
    page = Page(tr.to_html())
    assert [s[1] for s in page.spans] == ["a", "", "\u00e9a"]  # the half character waits for its round
    tr.chunks = [[a], [e1], [e2, e1]]  # the generation ends inside a character: the tail is still shown
    assert [s[1] for s in Page(tr.to_html()).spans] == ["a", "", "\u00e9\ufffd"]


def test_a_generation_without_rounds_still_shows_its_first_token():
    gen = generate(tiny_model(), TOK, [5, 6, 7, 8], max_new_tokens=1, trace=True)
    page = Page(gen.trace.to_html())
    assert gen.stats.rounds == 0 and page.trees == [] and gen.text
    assert page.spans == [["prefill", visible(gen.text)]]


def test_hook_records_agree_with_the_run_stats():
    gen, raw = _run(tiny_model(), [5, 6, 7], max_new_tokens=30, eos_token_id=[], mode="presto",
                    schedule="two-pass", budget=6, block_length=5)
    tr, s = gen.trace, gen.stats
    assert [r.accepted for r in tr.rounds] == s.accept_lengths
    assert tr.oracle_lengths() == s.oracle_lengths
    assert sum(r.query_tokens for r in tr.rounds) == s.query_tokens
    assert 0 < sum(r.forward_seconds for r in tr.rounds) <= s.forward_seconds
    assert [r.c for r in tr.rounds] == [3 + sum(s.accept_lengths[:i]) for i in range(s.rounds)]
    assert {r.layout for r in tr.rounds} == {"presto/two-pass/N=6"} and tr.rounds[0].lam == 0.2
    assert set(raw[0]) == {"round", "row", "c", "tree", "cands", "targets", "path", "bonus", "committed", "layout",
                           "forward_seconds", "query_tokens", "lam", "oracle_candidates"}
    assert {info["row"] for info in raw} == {0}


def test_score_split_is_log_q_plus_the_prefix_aligned_part():
    # the worked example of split_scores
    lq, rho = split_scores([7, 11, 13], [-1, 0, 1], [0, 1, 2], [0.0, -0.7, -1.9],
                           [[-0.5, -1.0], [-1.0, -2.0]], [[11, 12], [13, 14]])
    assert lq == [None, -0.5, -1.0] and rho[0] is None and rho[1:] == pytest.approx([-0.2, -0.2])
    # lambda = 0: the score is the sum of log q, nothing else
    gen, _ = _run(tiny_model(), [5, 6], max_new_tokens=16, eos_token_id=[], mode="presto", schedule="one-pass", rho="none", lam=0.0,
                  budget=6, block_length=4)
    parts = [p for r in gen.trace.rounds for p in r.rho_part[1:]]
    assert parts and all(p == pytest.approx(0.0, abs=1e-5) for p in parts)
    # n-gram rho: lambda * log rho <= 0 and not all zero
    gen, _ = _run(tiny_model(), [5, 6, 5, 6, 5], max_new_tokens=16, eos_token_id=[], mode="presto", schedule="one-pass", budget=6,
                  block_length=4, lam=0.5)
    parts = [p for r in gen.trace.rounds for p in r.rho_part[1:]]
    assert all(p <= 1e-6 for p in parts) and min(parts) < -1e-3
    node_lq = [q for r in gen.trace.rounds for q in r.log_q[1:]]
    assert node_lq and None not in node_lq  # every PRESTO node comes from the candidates


def test_hostile_token_text_renders_as_text_never_as_markup():
    tok = PieceTokenizer(HOSTILE)
    prompt = list(range(5, 5 + len(HOSTILE)))  # the prompt holds every hostile piece once
    gen, raw = _run(tiny_model(), prompt, tok=tok, max_new_tokens=40, eos_token_id=[], mode="presto", schedule="one-pass",
                    budget=8, block_length=5)
    doc = gen.trace.to_html()
    page = Page(doc)
    assert "script" not in page.tags and "img" not in page.tags
    assert "<script" not in doc.lower() and "<img" not in doc.lower() and "<!--" not in doc
    bad = [c for c in doc if unicodedata.category(c) == "Cc" and c not in "\n\t"]
    assert bad == []
    assert page.tags.count("svg") == len(page.trees) + 1  # the strip, and no </svg> from token text
    assert "".join(s[1] for s in page.spans) == visible(gen.text)
    assert any(t in gen.text for t in HOSTILE[:2] + HOSTILE[6:8])  # the generation did produce hostile text
    text_of_page = re.sub(r"<[^>]*>", "", doc)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text_of_page  # the prompt's piece, escaped


def test_visible_and_esc_examples():
    assert visible("a\x1bb\n") == "a\u241bb\n"
    assert visible(" \n", whitespace=True) == "\u2423\u21b5"
    assert esc('<b a="1">&') == "&lt;b a=&quot;1&quot;&gt;&amp;"
    assert short("  return x") == "\u2423\u2423return\u2026"


def test_tree_rows_put_each_node_on_its_own_cell():
    assert tree_rows([-1, 0, 0, 1], [0, -1, -2, -1.5]) == ([0, 0, 1, 0], None, 2)
    assert tree_rows([-1, 0, 0, 1], [0, -1, -2, -1.5], extra_after=1) == ([0, 0, 2, 1], 0, 3)
    torch.manual_seed(0)
    for _ in range(20):
        n = 30
        parents = [-1] + [int(torch.randint(0, v, ())) for v in range(1, n)]
        depths = [0] * n
        for v in range(1, n):
            depths[v] = depths[parents[v]] + 1
        end = int(torch.randint(0, n, ()))
        rows, extra, nrows = tree_rows(parents, None, extra_after=end)
        cells = [(depths[v], rows[v]) for v in range(n)] + [(depths[end] + 1, extra)]
        assert len(set(cells)) == len(cells) and max(r for _, r in cells) == nrows - 1
        for v in range(1, n):
            assert rows[v] >= rows[parents[v]]  # children are drawn at or below their parent


def test_rounds_past_max_trees_are_folded_and_256_tokens_at_budget_32_stay_under_2mb():
    # the worst case for size: a random model accepts almost nothing, so ~256 rounds of 33 nodes
    rope = dict(tiny_config().rope_parameters, original_max_position_embeddings=16)
    model = tiny_model(max_position_embeddings=512, rope_parameters=rope)
    gen = generate(model, TOK, [5, 6, 7], max_new_tokens=256, eos_token_id=[], mode="presto", budget=32,
                   schedule="two-pass", trace=True)
    assert gen.stats.rounds > 200 and len(gen.trace.rounds[5].tokens) == 33
    doc = gen.trace.to_html()
    page = Page(doc)
    assert len(page.trees) == 128 and page.folded_rows == gen.stats.rounds - 128
    assert len(doc.encode()) < 2_000_000, len(doc.encode())


def test_trace_option_is_checked_and_off_by_default():
    gen = generate(tiny_model(), TOK, [5, 6], max_new_tokens=4)
    assert gen.trace is None
    with pytest.raises(TypeError, match="trace must be a bool"):
        generate(tiny_model(), TOK, [5, 6], max_new_tokens=4, trace="yes")
    with pytest.raises(ValueError, match="max_trees"):
        Trace(TOK, [5]).to_html(max_trees=-1)


def test_cli_trace_writes_a_self_contained_page(tiny_dir, tmp_path, capsys):
    out = tmp_path / "t.html"
    rc = main(["trace", "--model", str(tiny_dir), "--prompt", "def f(x):\n", "--max-new-tokens", "12",
               "--block-length", "4", "--budget", "6", "--out", str(out)])
    assert rc == 0
    doc = out.read_text(encoding="utf-8")
    page = Page(doc)
    assert len(page.trees) >= 1 and "tau" in capsys.readouterr().err
    assert not re.search(r"(src|href)=\"(https?:)?//", doc) and "@import" not in doc and "<link" not in doc


def test_cli_trace_rejects_bad_input_before_loading(tmp_path, capsys):
    assert main(["trace", "--model", "/nonexistent/model", "--prompt", "x", "--budget", "0"]) == 2
    assert "budget" in capsys.readouterr().err
    out = tmp_path / "no_such_dir" / "t.html"
    assert main(["trace", "--model", "/nonexistent/model", "--prompt", "x", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no_such_dir" in err and "nonexistent" not in err
    assert not out.parent.exists()


@pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "model.safetensors")), reason="no shipped model")
def test_docs_example_draws_a_round_of_the_shipped_model(tmp_path):
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "round.svg"
    r = subprocess.run([sys.executable, os.path.join(root, "examples", "render_trace.py"), "--out", str(out)],
                       capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    page = Page(out.read_text(encoding="utf-8"))
    assert len(page.trees) == 1 and len(page.trees[0]["nodes"]) == 33 and len(page.trees[0]["accepted"]) >= 2
    assert "<style>" in out.read_text(encoding="utf-8")  # standalone: its own styles
