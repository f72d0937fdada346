"""One prompt's generation: the batch decoder (`batch.BatchDecoder`) with one row.

There is one round loop: plan, draft, lay out + forward, verify + commit, observe, over a list of
sequences (see `batch`'s docstring). A generation of one prompt runs it with one row, so every
layout, the batch-1 planner (`plan="auto"`: AR, lookup chains, PRESTO trees two-pass or
one-pass, probes), the predictor's recorder, learned rho and the round hook are the batch's own.
"""

from __future__ import annotations

import torch

from selfspec.engine.batch import BatchDecoder
from selfspec.engine.options import DecodeConfig
from selfspec.engine.request import check_request
from selfspec.engine.stats import Stats


class Decoder:
    """Runs one generation as an iterator of committed token chunks; `stats` fills as it goes.

    Hooks (None, or set before iterating):

    `recorder(tree, top_lq, top_tok, targets, entropy, history, ngram, node_logits)` after each
    round that verified a drafted tree from marginals (predictor collection): the marginals' top-K
    [D, K], the targets [n], the entropy [D] or None, the two tokens before the root, the n-gram
    rho and the target logits [n, V].

    `on_round(info: dict)`, the round hook: the contract any engine must keep (`selfspec.trace`
    builds on it). Called once per verification round, after the walk and after the round's
    tokens were emitted (eos / max_new_tokens truncation applied), with one plain dict holding
    exactly these keys:

        round              int, 0-based index of the verification round
        row                int, the prompt's index in its batch (0 here)
        c                  int, KV-cache length (accepted prefix) before the round
        tree               drafting.tree.Tree that was verified (node 0 = root, `scores` = path
                           scores from construction, or None)
        cands              (top_lq [D, K], top_tok [D, K], entropy [D] or None): the candidates
                           the tree was built from, or None (AR, lookup chains, no room left)
        targets            LongTensor [n]: the target's token after each node's path
        path               list[int]: accepted node indices, root first
        bonus              int: the target token at the end of the path
        committed          list[int]: tokens emitted by this round (accepted draft nodes + bonus,
                           after eos / max_new_tokens truncation)
        layout             str: "ar", "linear/two-pass", "presto/one-pass/N=32", ... (`layouts.config_label`;
                           plan "auto": the round's `Option.label`, e.g. "one-pass/N=8/m=9/G=8")
        forward_seconds    float: this round's model time (two-pass: both passes)
        query_tokens       int: query tokens this round's forwards ran (nodes + mask slots)
        lam                float: lambda of the score (0.0 outside PRESTO and auto)
        oracle_candidates  LongTensor [D, K]: the top-K candidate tokens per depth for oracle tau
    """

    def __init__(self, model, prompt_ids, cfg: DecodeConfig, *, eos_token_id=None,
                 generator: torch.Generator | None = None, profile=None):
        check_request(model, prompt_ids, cfg)
        # one request has no batch cache ceiling: its cache is what the request needs
        self.engine = BatchDecoder(model, [prompt_ids], cfg, eos_token_id=eos_token_id, generators=[generator],
                                   max_cache_bytes=1 << 62, profile=profile)
        self.cfg, self.eos = cfg, self.engine.eos
        self.prompt = self.engine.prompts[0]
        self.stats: Stats = self.engine.stats[0]
        self.emitted: list[int] = self.engine.outputs[0]

    @property
    def planner(self):
        """plan "auto": the batch-1 planner of this generation (None for a fixed mode)."""
        return self.engine.planner

    @property
    def recorder(self):
        return self.engine.recorder

    @recorder.setter
    def recorder(self, fn) -> None:
        self.engine.recorder = fn

    @property
    def on_round(self):
        return self.engine.on_round

    @on_round.setter
    def on_round(self, fn) -> None:
        self.engine.on_round = fn

    def __iter__(self):
        rows = iter(self.engine)
        try:
            for _, chunk in rows:
                yield chunk
        finally:  # a consumer that stops early (a stop string) still gets the stats so far
            rows.close()


def generate_ids(model, prompt_ids, cfg: DecodeConfig, **kw) -> tuple[list[int], Stats]:
    """All generated ids (prompt excluded) and the stats of the run."""
    dec = Decoder(model, prompt_ids, cfg, **kw)
    out = [t for chunk in dec for t in chunk]
    return out, dec.stats
