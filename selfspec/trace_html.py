"""A `Trace` as one self-contained HTML page: inline CSS and SVG, no scripts, nothing fetched.

Sections: the settings and totals; a strip of accepted length per round against the oracle;
the generated text with each round's committed span marked (each links to its round); then per
round the verified tree drawn left to right (depth = column): accepted path highlighted,
rejected nodes dimmed, the target token drawn as a dashed box after the node where the walk
stopped, scores in each node's SVG <title> (hover). The first `open_rounds` rounds are open,
later ones folded (<details>); rounds past `max_trees` get one summary line each, which bounds
the file size (about 0.3 kB per drawn node).

Every piece of model or prompt text goes through `esc`: HTML-escaped, and control characters
shown as visible symbols, so no tokenizer output can become markup.
"""

from __future__ import annotations

import html
import unicodedata

COL, BOX_W, ROW, BOX_H, PAD = 92, 72, 22, 18, 4
LABEL_CHARS = 9

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
code,pre,.tree text{font-family:ui-monospace,Menlo,Consolas,monospace}
pre.gen{white-space:pre-wrap;border:1px solid #ccc;padding:.6em;background:#fafafa}
pre.gen .prompt{color:#888}
pre.gen a.c{color:inherit;text-decoration:none;border-bottom:2px solid #7aa7d9}
pre.gen a.c.k1{background:#e6f0ff}pre.gen a.c.k0{background:#fff2dc;border-color:#d9a54a}
pre.gen a.c.pre{background:#eee;border-color:#999}
.scroll{overflow-x:auto;max-width:100%}
details.round{margin:.4em 0;border-left:3px solid #ddd;padding-left:.6em}
details.round summary{cursor:pointer}
.meta{color:#555;font-size:12px;margin:.2em 0}
.tree rect{stroke-width:1}
.tree text{font-size:11px;dominant-baseline:central}
.tree .n rect{fill:#f1f1f1;stroke:#999}
.tree .n.r{opacity:.45}
.tree .n.a rect{fill:#c9efc9;stroke:#2a8a2a;stroke-width:1.5}
.tree .t rect{fill:#fff3c4;stroke:#c08a00;stroke-dasharray:3 2}
.tree path{fill:none;stroke:#bbb}
.tree path.a{stroke:#2a8a2a;stroke-width:2}
.tree path.t{stroke:#c08a00;stroke-dasharray:3 2}
.strip .sa{fill:#2a8a2a}.strip .so{fill:none;stroke:#c08a00}
table.sum td,table.sum th{padding:0 .6em;text-align:left;font-size:12px}
.legend span{display:inline-block;padding:0 .4em;margin-right:.6em;border:1px solid #999;font-size:12px}
"""

_PICTURES = {0x7F: "\u2421"}


def visible(text: str, *, whitespace: bool = False) -> str:
    """Control characters (and surrogates, U+FFFE/U+FFFF) as visible symbols; newline and tab kept.

    With whitespace=True (node labels) space, newline and tab become visible too.
    Example: visible("a\\x1bb\\n") == "a\u241bb\\n"; visible(" \\n", whitespace=True) == "\u2423\u21b5".
    """
    out = []
    for ch in text:
        o = ord(ch)
        if whitespace and ch in " \n\t":
            out.append({" ": "\u2423", "\n": "\u21b5", "\t": "\u21e5"}[ch])
        elif ch in "\n\t":
            out.append(ch)
        elif o < 0x20:
            out.append(chr(0x2400 + o))  # the Unicode control pictures
        elif o in _PICTURES:
            out.append(_PICTURES[o])
        elif unicodedata.category(ch) in ("Cc", "Cs") or o in (0xFFFE, 0xFFFF):
            out.append(f"\\u{o:04x}")
        else:
            out.append(ch)
    return "".join(out)


def esc(text: str, *, whitespace: bool = False) -> str:
    """Text -> safe HTML text or attribute value: esc('<b a="1">&') == '&lt;b a=&quot;1&quot;&gt;&amp;'."""
    return html.escape(visible(text, whitespace=whitespace), quote=True)


def short(text: str, n: int = LABEL_CHARS) -> str:
    """A node label: whitespace made visible, cut to n characters: short("  return x") == "␣␣return…"."""
    s = visible(text, whitespace=True)
    return s if len(s) <= n else s[: n - 1] + "\u2026"


def tree_rows(parents: list[int], scores: list[float] | None = None, extra_after: int | None = None):
    """Row of every node for a left-to-right drawing; children best-score first, a node on its first child's row.

    `extra_after` adds one pseudo child (the target box) as the first child of that node.
    Returns (rows per node, row of the extra box or None, number of rows).
    Example: parents [-1, 0, 0, 1], scores [0, -1, -2, -1.5] -> rows [0, 0, 1, 0], 2 rows;
    with extra_after=1 the extra box takes row 0 and the rows become [0, 0, 2, 1], 3 rows.
    """
    n = len(parents)
    kids: list[list[int]] = [[] for _ in range(n)]
    for v in range(1, n):
        kids[parents[v]].append(v)
    if scores is not None:
        for k in kids:
            k.sort(key=lambda v: (-scores[v], v))
    order, stack = [], [0] if n else []  # pre-order; -2 is the extra box, visited before the children
    while stack:
        v = stack.pop()
        order.append(v)
        if v >= 0:
            stack.extend(reversed(kids[v]))
            if v == extra_after:
                stack.append(-2)
    rows, extra_row, nxt = [-1] * n, None, 0
    for v in order:  # leaves (and the extra box) take rows top to bottom
        if v == -2:
            extra_row, nxt = nxt, nxt + 1
        elif not kids[v] and v != extra_after:
            rows[v], nxt = nxt, nxt + 1
    for v in reversed(order):  # inner nodes sit on their first child's row (children come first here)
        if v >= 0 and rows[v] == -1:
            rows[v] = extra_row if v == extra_after else rows[kids[v][0]]
    return rows, extra_row, max(nxt, 1)


class _TokenText:
    """Display text of single tokens, cached; falls back to the piece name, then to #id."""

    def __init__(self, tokenizer):
        self.tok, self.cache = tokenizer, {}

    def __call__(self, t: int) -> str:
        if t not in self.cache:
            s = self.tok.decode([t], skip_special_tokens=False)
            if (not s or "\ufffd" in s) and hasattr(self.tok, "convert_ids_to_tokens"):
                s = str(self.tok.convert_ids_to_tokens([t])[0] or "")
            self.cache[t] = s if s else f"#{t}"
        return self.cache[t]


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def draw_tree(r, text) -> str:
    """One round's tree as an <svg class="tree"> (nodes <g class="n a|r" data-node=i>, target <g class="t">)."""
    n, path = len(r.tokens), set(r.path)
    end = r.path[-1]
    rows, trow, nrows = tree_rows(r.parents, r.scores, extra_after=end)
    max_col = max(r.depths) if n else 0
    max_col = max(max_col, r.depths[end] + 1)
    w, h = PAD * 2 + max_col * COL + BOX_W, PAD * 2 + nrows * ROW
    out = [f'<svg class="tree" data-round="{r.round}" data-nodes="{n}" width="{w}" height="{h}" '
           f'viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg">']

    def xy(depth, row):
        return PAD + depth * COL, PAD + row * ROW

    def edge(pd, prow, cd, crow, cls):
        x0, y0 = xy(pd, prow)
        x1, y1 = xy(cd, crow)
        x0, y0, y1, xm = x0 + BOX_W, y0 + BOX_H // 2, y1 + BOX_H // 2, (x0 + BOX_W + x1) // 2
        c = f' class="{cls}"' if cls else ""
        return f'<path{c} d="M{x0} {y0}C{xm} {y0} {xm} {y1} {x1} {y1}"/>'

    for v in range(1, n):
        p = r.parents[v]
        out.append(edge(r.depths[p], rows[p], r.depths[v], rows[v], "a" if v in path and p in path else ""))
    out.append(edge(r.depths[end], rows[end], r.depths[end] + 1, trow, "t"))
    for v in range(n):
        x, y = xy(r.depths[v], rows[v])
        t = r.tokens[v]
        tip = [f"node {v} \u00b7 depth {r.depths[v]} \u00b7 \u201c{text(t)}\u201d (id {t})"]
        if v == 0:
            tip.append("root: the previous round's bonus token")
        else:
            tip.append(f"path score {_fmt(r.scores[v] if r.scores else None)}")
            tip.append(f"log q {_fmt(r.log_q[v])} \u00b7 \u03bb\u00b7log \u03c1 {_fmt(r.rho_part[v])}")
        tip.append(f"target after it: \u201c{text(r.targets[v])}\u201d (id {r.targets[v]})")
        tip.append("accepted" if v in path else "rejected")
        out.append(f'<g class="n {"a" if v in path else "r"}" data-node="{v}"><title>{esc(chr(10).join(tip))}</title>'
                   f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="3"/>'
                   f'<text x="{x + 4}" y="{y + BOX_H // 2}">{esc(short(text(t)))}</text></g>')
    x, y = xy(r.depths[end] + 1, trow)
    tip = f"target token \u201c{text(r.bonus)}\u201d (id {r.bonus}): the walk stopped at node {end}; the bonus"
    out.append(f'<g class="t"><title>{esc(tip)}</title>'
               f'<rect x="{x}" y="{y}" width="{BOX_W}" height="{BOX_H}" rx="3"/>'
               f'<text x="{x + 4}" y="{y + BOX_H // 2}">{esc(short(text(r.bonus)))}</text></g>')
    out.append("</svg>")
    return "".join(out)


def round_svg(trace, i: int) -> str:
    """Round i's tree as a standalone SVG file (its own styles, white background), e.g. for docs."""
    svg = draw_tree(trace.rounds[i], _TokenText(trace.tokenizer))
    css = "".join(line + "\n" for line in CSS.splitlines() if line.startswith((".tree", "code,pre")))
    head, rest = svg.split(">", 1)
    return (f'{head}><style>{css}text{{font-family:monospace}}</style><rect width="100%" height="100%" fill="#fff"/>'
            f"{rest}\n")


def draw_strip(accepted: list[int], oracle: list[int]) -> str:
    """Accepted length per round (filled bars) against the oracle (outlined bars); each bar links to its round."""
    bw, gap, unit = 6, 2, 10
    top = max([1] + accepted + oracle)
    w, h = max(1, len(accepted)) * (bw + gap) + 2 * PAD, top * unit + 2 * PAD
    out = [f'<svg class="strip" width="{w}" height="{h}" viewBox="0 0 {w} {h}" xmlns="http://www.w3.org/2000/svg">']
    for i, (a, o) in enumerate(zip(accepted, oracle)):
        x = PAD + i * (bw + gap)
        out.append(f'<a href="#r{i}"><title>round {i}: accepted {a}, oracle {o}</title>'
                   f'<rect class="so" x="{x}" y="{h - PAD - o * unit}" width="{bw}" height="{o * unit}"/>'
                   f'<rect class="sa" x="{x}" y="{h - PAD - a * unit}" width="{bw}" height="{a * unit}"/></a>')
    out.append("</svg>")
    return "".join(out)


def text_spans(tokenizer, chunks: list[list[int]]) -> list[str]:
    """Each chunk's share of the decoded text; the shares concatenate to the full decode."""
    from selfspec.checkpoint.tokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer(tokenizer)
    spans = [d.push(ch) for ch in chunks]
    if spans:
        spans[-1] += d.flush()
    return spans


LEGEND_STRIP = ('<p class="legend"><span style="background:#2a8a2a;color:#fff">accepted (tokens committed)</span>'
                '<span style="border-color:#c08a00">oracle (perfect tree, same top-K)</span></p>')
LEGEND_TREE = ('<p class="legend"><span style="background:#c9efc9">accepted path</span><span style="opacity:.45">rejected'
               '</span><span style="background:#fff3c4;border-style:dashed">target where the walk stopped (bonus)</span>'
               " \u00b7 hover a node for its scores</p>")


def render(trace, *, open_rounds: int = 8, max_trees: int = 128) -> str:
    """The whole page for a `selfspec.trace.Trace` (see the module docstring)."""
    if open_rounds < 0 or max_trees < 0:
        raise ValueError(f"open_rounds and max_trees must be >= 0, got {open_rounds}, {max_trees}")
    rounds, oracle = trace.rounds, trace.oracle_lengths()
    text = _TokenText(trace.tokenizer)
    spans = text_spans(trace.tokenizer, trace.token_chunks)
    layout = rounds[0].layout if rounds else str(trace.settings.get("mode", ""))
    out = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
           f"<title>selfspec trace \u00b7 {esc(layout)}</title><style>{CSS}</style></head><body>",
           f'<h1 id="top">selfspec trace <small>{esc(layout)}</small></h1>', _totals(trace, oracle)]
    if trace.settings:
        out.append('<p class="meta">' + esc(" \u00b7 ".join(f"{k}={v}" for k, v in trace.settings.items())) + "</p>")
    out += ["<h2>Accepted length per round</h2>", LEGEND_STRIP,
            f'<div class="scroll">{draw_strip([r.accepted for r in rounds], oracle)}</div>',
            "<h2>Generated text</h2>", _text(trace, spans), "<h2>Rounds</h2>", LEGEND_TREE]
    for r, o in zip(rounds[:max_trees], oracle):
        said = esc(spans[r.round + 1]) if r.round + 1 < len(spans) else ""
        out.append(f'<details class="round" id="r{r.round}"{" open" if r.round < open_rounds else ""}><summary>'
                   f"round {r.round} \u00b7 {len(r.tokens)} nodes \u00b7 accepted {len(r.path) - 1} + bonus "
                   f"(oracle {o}) \u00b7 <code>{said}</code></summary>"
                   f'<div class="meta">cache {r.c} \u00b7 {esc(r.layout)} \u00b7 \u03bb {r.lam:g} \u00b7 '
                   f"forward {r.forward_seconds * 1e3:.2f} ms \u00b7 {r.query_tokens} query tokens</div>"
                   f'<div class="scroll">{draw_tree(r, text)}</div></details>')
    if len(rounds) > max_trees:  # folded for good: one table row per round keeps big runs small
        out.append(f'<details class="folded"><summary>rounds {max_trees}-{len(rounds) - 1} (trees not drawn: '
                   f'past max_trees={max_trees})</summary><table class="sum"><tr><th>round</th><th>nodes</th>'
                   "<th>accepted</th><th>oracle</th><th>committed</th></tr>")
        for r, o in zip(rounds[max_trees:], oracle[max_trees:]):
            said = esc(spans[r.round + 1]) if r.round + 1 < len(spans) else ""
            out.append(f'<tr id="r{r.round}"><td>{r.round}</td><td>{len(r.tokens)}</td><td>{r.accepted}</td>'
                       f"<td>{o}</td><td><code>{said}</code></td></tr>")
        out.append("</table></details>")
    out.append("</body></html>\n")
    return "".join(out)


def _totals(trace, oracle: list[int]) -> str:
    rounds = trace.rounds
    n = max(len(rounds), 1)
    tau, otau = sum(r.accepted for r in rounds) / n, sum(oracle) / n
    fwd = sum(r.forward_seconds for r in rounds)
    return (f'<p class="meta">{len(trace.prompt_ids)} prompt tokens \u00b7 {len(trace.token_ids)} new tokens \u00b7 '
            f"{len(rounds)} rounds \u00b7 tau {tau:.2f} (oracle {otau:.2f}) \u00b7 model time {fwd * 1e3:.1f} ms "
            f"\u00b7 {sum(r.query_tokens for r in rounds)} query tokens</p>")


def _text(trace, spans: list[str]) -> str:
    """The prompt (dim), then one <a class="c"> per chunk: the prefill's token, then each round's tokens."""
    prompt = esc(trace.tokenizer.decode(trace.prompt_ids, skip_special_tokens=True))
    out = [f'<pre class="gen"><span class="prompt">{prompt}</span>']
    for i, (s, chunk) in enumerate(zip(spans, trace.token_chunks)):
        if i == 0:
            out.append(f'<a class="c pre" data-round="prefill" href="#top" title="prefill">{esc(s)}</a>')
        else:
            out.append(f'<a class="c k{(i - 1) % 2}" data-round="{i - 1}" href="#r{i - 1}" '
                       f'title="round {i - 1}: {len(chunk)} tokens">{esc(s)}</a>')
    out.append("</pre>")
    return "".join(out)
