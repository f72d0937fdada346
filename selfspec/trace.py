"""Per-round traces of a generation: what was drafted, how it was scored, what was accepted.

    gen = selfspec.generate(model, tok, "def add(a, b):\\n", max_new_tokens=64, trace=True)
    gen.trace.rounds[0].path            # accepted node indices of round 0, root first
    open("trace.html", "w").write(gen.trace.to_html())

    python -m selfspec trace --prompt "class Stack:" --budget 32 --out trace.html

The page itself is drawn by `selfspec.trace_html` (one self-contained file, no scripts).

Records are built from the decoder's round hook, `Decoder.on_round`: its contract (one dict per
round, which keys, what they hold) is in the `selfspec.engine.schedule.decoder.Decoder` docstring.

Score split of a node v with parent p at depth d: log q = the log marginal of v's token in
row d-1 of `cands` (None when the token is not among them, e.g. a candidate from another
source); the prefix-aligned part lambda * log rho = score(v) - score(p) - log q.
"""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.drafting.sampling import oracle_length


@dataclass(frozen=True)
class RoundRecord:
    """One verification round as plain Python data (no tensors)."""

    round: int
    c: int
    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float] | None  # path scores, root 0
    log_q: list[float | None]  # per node; None for the root and for tokens not among the candidates
    rho_part: list[float | None]  # lambda * log rho per node (score - parent score - log q)
    targets: list[int]
    path: list[int]
    bonus: int
    committed: list[int]
    layout: str
    forward_seconds: float
    query_tokens: int
    lam: float
    oracle_candidates: list[list[int]]

    @property
    def accepted(self) -> int:
        """Tokens this round committed (accepted draft nodes + bonus)."""
        return len(self.committed)


def split_scores(tokens, parents, depths, scores, top_lq, top_tok):
    """(log q, lambda * log rho) per node from path scores and the candidates the tree came from.

    Example: root 7 with child 11 (depth 1) and grandchild 13 (depth 2), path scores
    [0, -0.7, -1.9]; candidates row 0 = {11: -0.5, 12: -1.0}, row 1 = {13: -1.0, 14: -2.0}:
        log q    = [None, -0.5, -1.0]
        rho part = [None, -0.2, -0.2]      (-0.7 - 0 - (-0.5), -1.9 - (-0.7) - (-1.0))
    Lists in, lists out; a node whose token is not in its depth's row gets None for both.
    """
    n = len(tokens)
    lq: list[float | None] = [None] * n
    rho: list[float | None] = [None] * n
    for v in range(1, n):
        row = depths[v] - 1
        if top_tok is None or row >= len(top_tok) or tokens[v] not in top_tok[row]:
            continue
        lq[v] = float(top_lq[row][top_tok[row].index(tokens[v])])
        if scores is not None:
            rho[v] = float(scores[v] - scores[parents[v]] - lq[v])
    return lq, rho


def record_from_info(info: dict) -> RoundRecord:
    """The round hook's dict (contract: the `Decoder` docstring) -> a RoundRecord of plain lists."""
    tree, cands = info["tree"], info["cands"]
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    scores = None if tree.scores is None else [float(s) for s in tree.scores.tolist()]
    top_lq, top_tok = (cands[0].tolist(), cands[1].tolist()) if cands is not None else (None, None)
    lq, rho = split_scores(tokens, parents, depths, scores, top_lq, top_tok)
    return RoundRecord(
        round=int(info["round"]), c=int(info["c"]), tokens=tokens, parents=parents, depths=depths, scores=scores,
        log_q=lq, rho_part=rho, targets=[int(t) for t in info["targets"].tolist()], path=[int(p) for p in info["path"]],
        bonus=int(info["bonus"]), committed=[int(t) for t in info["committed"]], layout=str(info["layout"]),
        forward_seconds=float(info["forward_seconds"]), query_tokens=int(info["query_tokens"]), lam=float(info["lam"]),
        oracle_candidates=info["oracle_candidates"].tolist(),
    )


class Trace:
    """Collects RoundRecords through the runtime hook (`add`) and renders them (`to_html`).

    `chunks` are the token chunks the generation emitted (chunk 0 is the prefill's first token,
    chunk i the tokens of round i-1); `selfspec.stream(..., trace=True)` fills them. A trace fed
    by the hook alone takes the first token from round 0's root. With a stop string the page
    shows the last round's tokens whole (`Generation.text` ends before the stop string).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], *, settings: dict | None = None):
        self.tokenizer = tokenizer
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.settings = dict(settings or {})
        self.rounds: list[RoundRecord] = []
        self.chunks: list[list[int]] = []

    def add(self, info: dict) -> None:
        """The `Decoder.on_round` callback."""
        self.rounds.append(record_from_info(info))

    def add_chunk(self, chunk: list[int]) -> None:
        self.chunks.append([int(t) for t in chunk])

    @property
    def token_chunks(self) -> list[list[int]]:
        """[first token], then each round's committed tokens."""
        if self.chunks:
            return self.chunks
        if not self.rounds:
            return []
        return [[self.rounds[0].tokens[0]]] + [r.committed for r in self.rounds]

    @property
    def token_ids(self) -> list[int]:
        return [t for ch in self.token_chunks for t in ch]

    def oracle_lengths(self) -> list[int]:
        """Per round: what a perfect tree in the same top-K candidate space would have committed."""
        out, rest = [], [t for r in self.rounds for t in r.committed]
        for r in self.rounds:
            out.append(oracle_length(_as_tensor(r.oracle_candidates), rest))
            rest = rest[len(r.committed):]
        return out

    def to_html(self, *, open_rounds: int = 8, max_trees: int = 128) -> str:
        """One self-contained HTML page; see `selfspec.trace_html.render`."""
        from selfspec.trace_html import render

        return render(self, open_rounds=open_rounds, max_trees=max_trees)

    def save(self, path: str, **kw) -> int:
        """Write `to_html(**kw)` to `path` (UTF-8); returns the number of bytes written."""
        data = self.to_html(**kw).encode("utf-8")
        with open(path, "wb") as f:
            f.write(data)
        return len(data)


def _as_tensor(rows: list[list[int]]):
    import torch

    return torch.tensor(rows, dtype=torch.long) if rows else torch.zeros(0, 1, dtype=torch.long)
