"""The decoding engine: AR, linear and PRESTO drafts, two-pass or one-pass, fixed or planned.

Every round starts from the same state: the KV cache holds the accepted prefix (length c) and
`root`, the last emitted token, is not in the cache yet; `marg` holds diffusion marginals for
the depths after the root when the previous round left some (one-pass) and None otherwise.
A round is one `rounds.Round` that these steps fill in order (`Decoder._run`):

1. plan (`_plan`): a fixed mode's option every round, or `planner.Planner.plan` (plan "auto";
   the planner owns its rest countdown and drafts the largest tree it may pick from);
2. draft (`_draft_step`): two-pass first runs [root, M x (B-1)] bidirectional over the cache;
   marginals -> a tree rooted at `root` (AR: the root; linear: a chain; PRESTO: the top-N tree
   of `tree.build_tree`; lookup: the copied chain);
3. lay out + forward (`_forward_step`): mask-group owners (one-pass, `tree.group_owners`), tree
   nodes + groups in one call of the compact forward, mask block from `masks.tree_block`, K/V
   written in place; the target's token after every node (`sampling.select`);
4. verify + commit (`_verify_commit`): `verify.walk`; the next marginals from the endpoint's
   group or its nearest ancestor's shifted by the depth gap (slot 0 of a group is the bonus
   position); commit the accepted path (`cache.KVCache.commit`); emit;
5. observe: every observer gets the finished round (stats, the planner's calibration, the
   predictor's recorder, the round hook).
"""

from __future__ import annotations

import time

import torch

from selfspec.engine.options import DecodeConfig
from selfspec.engine.request import check_request, eos_ids, scratch
from selfspec.engine.forward import engine
from selfspec.drafting.lookup import ContextIndex
from selfspec.engine.masks import tree_block
from selfspec.engine.layouts import config_label, fixed_option
from selfspec.engine.planner import Forecast, keep_planner, planner_for
from selfspec.engine.rounds import Round, recorder_observer, stats_observer
from selfspec.engine.stats import Stats
from selfspec.drafting.sampling import select
from selfspec.drafting.scoring import NgramRho, make_extra_score, path_context
from selfspec.drafting.tree import (ContextCandidates, Marginals, Tree, build_tree, chain, group_owners, nearest_owner, root_only,
                   top_nodes)
from selfspec.drafting.verify import oracle_length, truncate, walk


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
        self.model, self.cfg = model, cfg
        self.prompt = [int(t) for t in prompt_ids]
        self.eos = eos_ids(model, eos_token_id)
        self.mask_id = int(model.config.mask_token_id)
        self.gen = generator
        self.lora = getattr(model, "draft_lora", None) if cfg.draft_lora else None
        self.ff = engine(model)
        self.stats = Stats()
        trees = cfg.mode in ("presto", "auto")
        self.rho = NgramRho(model.config.vocab_size, self.prompt) if trees and cfg.rho in ("ngram", "learned") else None
        self.learned = trees and cfg.rho == "learned"
        if self.learned:
            from selfspec.drafting.learned_rho import LearnedRho

            self.extra = make_extra_score(LearnedRho(model.presto_predictor, self.rho), cfg.lam)
        else:
            self.extra = make_extra_score(self.rho, cfg.lam) if trees else None
        self.recorder = None  # see the class docstring
        self.on_round = None
        self.k = cfg.tree_top_k if trees else 1
        uses_index = cfg.mode == "lookup" or (trees and cfg.lookup)
        self.index = ContextIndex(self.prompt, min_ngram=cfg.lookup_min_ngram,
                                  max_ngram=cfg.lookup_max_ngram) if uses_index else None
        self.planner = planner_for(model, cfg, profile) if cfg.mode == "auto" else None
        self.fixed = None if self.planner is not None else fixed_option(cfg)
        self.fixed_label = config_label(cfg)
        self.cache = self.ff.new_cache(len(self.prompt) + cfg.max_new_tokens + scratch(cfg) + 1)
        self._match = 1  # n-gram length behind the latest lookup forecast
        self._pending_oracle: list[tuple[int, torch.Tensor]] = []
        self.emitted: list[int] = []

    # -- model calls ---------------------------------------------------------------------------------
    def _forward(self, tokens: torch.Tensor, offsets: torch.Tensor, block, *, draft_from: int | None = None,
                 causal: bool = False) -> torch.Tensor:
        """One model call over new tokens at cache.length + offsets; the draft LoRA on rows >= draft_from."""
        t0 = time.perf_counter()
        lora = self.lora if draft_from is not None else None
        hidden = self.ff(tokens, self.cache.length + offsets, self.cache, block=block, causal=causal, lora=lora,
                         lora_rows=slice(draft_from, None) if lora is not None else None)
        if hidden.is_cuda:
            torch.cuda.synchronize(hidden.device)
        self.stats.forward_seconds += time.perf_counter() - t0
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on the rows a step reads; model time, counted with the forwards."""
        t0 = time.perf_counter()
        logits = self.ff.logits(hidden)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.stats.forward_seconds += time.perf_counter() - t0
        return logits

    def _targets(self, logits: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        return select(logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                      banned=self.mask_id, generator=self.gen).cpu()

    def _marginals(self, hidden: torch.Tensor) -> Marginals | None:
        if hidden.shape[0] == 0:
            return None
        return Marginals.from_logits(self._head(hidden), self.cfg.tree_top_k, self.mask_id,
                                     entropy=self.learned or self.recorder is not None)

    # -- steps -----------------------------------------------------------------------------------------
    def _prefill(self, with_group: bool) -> tuple[int, Marginals | None]:
        """The prompt causally; with_group: then one mask group after it (read-only) for marginals."""
        L = len(self.prompt)
        hidden = self._forward(torch.tensor(self.prompt), torch.arange(L), None, causal=True)
        self.cache.commit_all(L)
        first = int(self._targets(self._head(hidden[-1:]))[0])
        self.stats.prefill_forwards = 1
        if not with_group:
            return first, None
        G = self.cfg.group
        # the group sits at positions L .. L+G-1: slot 0 is where `first` goes, later slots its successors
        hidden = self._forward(torch.full((G,), self.mask_id), torch.arange(G), None, draft_from=0)
        self.stats.prefill_forwards = 2
        return first, self._marginals(hidden[1:])

    def _draft_pass(self, root: int) -> Marginals:
        """Two-pass draft: [root, M x (B-1)] bidirectional over the cache, which it leaves as is."""
        B = self.cfg.block_length
        block = torch.cat([torch.tensor([root]), torch.full((B - 1,), self.mask_id)])
        hidden = self._forward(block, torch.arange(B), None, draft_from=0)
        self.stats.forwards += 1
        self.stats.query_tokens += B
        return self._marginals(hidden[1:])

    def _draft(self, root: int, marg: Marginals | None, nodes: int, room: int) -> Tree:
        """Marginals -> tree: root only, a chain (linear) or PRESTO's top-`nodes` tree."""
        if nodes < 1 or marg is None or room <= 1:
            return root_only(root)
        depth = min(len(marg), room - 1)
        if self.cfg.mode == "linear":
            lq, tok = marg.top_lq[:depth, 0], marg.top_tok[:depth, 0]
            return chain([root] + tok.tolist(), torch.cat([torch.zeros(1), lq.cumsum(0)]))
        tail = self._tail(max(2, self.cfg.lookup_max_ngram))
        h2 = path_context(tail, [], 2)[0]
        ctx = None
        if self.cfg.lookup and self.index is not None and marg.logq is not None:
            ctx = ContextCandidates(lambda path: self.index.continuations(path, 2), marg.logq,
                                    tuple(tail[-self.cfg.lookup_max_ngram:]))
        return build_tree(root, marg.top_lq[:, : self.k], marg.top_tok[:, : self.k], budget=nodes,
                          extra_score=self.extra, history=(h2, root), max_depth=depth, entropy=marg.entropy,
                          lookup=ctx)

    def _lookup_drafts(self, room: int) -> list[int]:
        """Prompt lookup: the tokens that followed the latest match of the context's last n-gram."""
        if room <= 1:
            return []
        tail = self._tail(self.cfg.lookup_max_ngram)
        self._match = self.index.match_length(tail)
        return self.index.propose(tail, min(self.cfg.lookup_tokens, room - 1))

    def _forecast(self, root: int, marg: Marginals | None, room: int) -> tuple[Forecast, Tree | list | None]:
        """The largest tree the planner may pick from (or the lookup chain, as a list), with
        calibrated acceptance per node."""
        if room <= 1:
            return Forecast(), None
        if marg is None:
            if self.index is None:
                return Forecast(), None
            drafted = self._lookup_drafts(room)
            if not drafted:
                return Forecast(), None
            acc, run = [1.0], 1.0
            for p in self.planner.lookup_calibrator.prob(len(drafted), self._match):
                run *= p
                acc.append(run)
            return Forecast(acc, kind="lookup"), drafted
        tree = self._draft(root, marg, self.cfg.budget, room)
        return self.planner.forecast_tree(tree), tree

    @staticmethod
    def _next_marginals_rows(tree: Tree, owners: torch.Tensor, end: int) -> tuple[int, int]:
        """(group index, first row inside the group) of the marginals after the accepted endpoint.

        The endpoint's own group, or its nearest ancestor's: slot 0 sits where the bonus goes,
        so the next round's depth 1 is slot 1 + (depth(end) - depth(owner)).
        Example: endpoint at depth 3 whose nearest owner is at depth 1 -> rows from slot 3.
        """
        j, u = nearest_owner(tree.parents, owners, end)
        return j, 1 + int(tree.depths[end] - tree.depths[u])

    # -- the loop ------------------------------------------------------------------------------------------
    def __iter__(self):
        t_start = time.perf_counter()
        try:
            yield from self._run()
        finally:
            self.stats.seconds = time.perf_counter() - t_start
            self._finish_oracle()
            if self.planner is not None:
                keep_planner(self.planner)

    def _emit(self, tokens: list[int]) -> tuple[list[int], bool]:
        """Truncate at eos (inclusive) and at max_new_tokens; returns (chunk, finished)."""
        out, done = truncate(tokens, self.eos, self.cfg.max_new_tokens - len(self.emitted))
        done = done or len(self.emitted) + len(out) >= self.cfg.max_new_tokens
        self.emitted.extend(out)
        self.stats.new_tokens = len(self.emitted)
        if self.rho is not None and out:
            self.rho.extend(out)
        if self.index is not None and out:
            self.index.extend(out)
        return out, done

    def _tail(self, n: int) -> list[int]:
        """The last n committed tokens (the root is the last), without copying the whole text."""
        e = self.emitted
        return e[-n:] if len(e) >= n else self.prompt[len(self.prompt) - (n - len(e)):] + e

    # -- a round's steps (each fills its part of the `Round`) -----------------------------------------
    def _plan(self, r: Round) -> None:
        """The layout: the fixed mode's option, or the planner's choice (with what it drafted)."""
        if self.fixed is not None:
            r.option, r.layout = self.fixed, self.fixed_label
            return
        t0 = time.perf_counter()
        r.option, drafted = self.planner.plan(lambda: self._forecast(r.root, r.marg, r.room), r.c, r.room,
                                              r.marg is not None)
        if isinstance(drafted, list):
            r.drafted, r.match = drafted, self._match
        else:
            r.big = drafted
        r.layout = r.option.label
        self.stats.tree_seconds += time.perf_counter() - t0

    def _draft_step(self, r: Round) -> None:
        """The tree: a draft pass first (two-pass), then a lookup chain, the planner's top-N
        subtree, or a fresh tree from the marginals."""
        cfg, option, marg = self.cfg, r.option, r.marg
        if option.draft_pass:
            marg = self._draft_pass(r.root) if r.room > 1 else None
        t0 = time.perf_counter()
        if option.source == "lookup":
            drafted = (self._lookup_drafts(r.room) if r.drafted is None else r.drafted)[: option.nodes]
            r.match = self._match
            r.tree = chain([r.root] + drafted, torch.zeros(len(drafted) + 1))
        elif r.big is not None and not option.draft_pass:
            r.tree = top_nodes(r.big, option.nodes) if option.nodes else root_only(r.root)
        else:
            r.tree = self._draft(r.root, marg, option.nodes, r.room)
        self.stats.tree_seconds += time.perf_counter() - t0
        r.drafted_from = marg
        if self.recorder is not None:
            r.history = tuple(path_context(self._tail(2), [], 2))
        if marg is not None or (self.fixed is not None and cfg.mode not in ("ar", "lookup")):
            empty = torch.zeros(0, 1, dtype=torch.long)
            self._pending_oracle.append((r.emitted_before, empty if marg is None else marg.top_tok[:, : cfg.tree_top_k]))

    def _forward_step(self, r: Round) -> None:
        """Tree nodes plus mask groups in one forward; the targets at the tree's nodes."""
        tree, option, n = r.tree, r.option, r.n
        groups = option.groups if r.room > 1 else 0
        r.owners = group_owners(tree, groups) if groups else None
        r.group_size = G = option.group_size or self.cfg.group
        if n == 1 and r.owners is None:  # AR: one token that sees the prefix, no mask to build
            block, offsets, tokens = None, tree.depths, tree.tokens
        else:
            block, offsets = tree_block(tree.parents, tree.depths, r.owners, G if r.owners is not None else 0)
            tokens = torch.cat([tree.tokens, torch.full((block.shape[0] - n,), self.mask_id)])
        r.hidden = self._forward(tokens, offsets, None if tokens.shape[0] == 1 else block,
                                 draft_from=n if r.owners is not None else None)
        self.stats.forwards += 1
        self.stats.query_tokens += tokens.shape[0]
        r.logits = self._head(r.hidden[:n])
        r.targets = self._targets(r.logits)

    def _verify_commit(self, r: Round) -> bool:
        """Walk, next marginals (one-pass), commit into the cache, emit; True when finished."""
        r.path, r.bonus = walk(r.tree, r.targets)
        if r.owners is not None:
            G, n = r.group_size, r.n
            j, skip = self._next_marginals_rows(r.tree, r.owners, r.path[-1])
            r.next_marg = self._marginals(r.hidden[n + j * G + skip : n + (j + 1) * G])
        r.hidden = None  # not kept past the round
        self.cache.commit(r.path)
        r.committed, done = self._emit(r.tree.tokens[r.path[1:]].tolist() + [r.bonus])
        r.seconds = time.perf_counter() - r.t_start
        r.forward_seconds = self.stats.forward_seconds - r.forward_before
        r.query_tokens = self.stats.query_tokens - r.query_before
        return done

    def _observers(self) -> list:
        """Who reads a finished round, in order: stats, the planner, the recorder, the round hook."""
        obs = [stats_observer(self.stats)]
        if self.planner is not None:
            obs.append(self.planner.observe)
        if self.recorder is not None:
            obs.append(recorder_observer(self.recorder, self.k, self.rho))
        if self.on_round is not None:
            lam = self.cfg.lam if self.cfg.mode in ("presto", "auto") else 0.0
            hook, top_k = self.on_round, self.cfg.tree_top_k
            obs.append(lambda r: hook(r.info(lam, top_k)))
        return obs

    def _run(self):
        root, marg = self._prefill(with_group=self.planner is not None or self.fixed.groups > 0)
        chunk, done = self._emit([root])
        yield chunk
        observers = self._observers()
        while not done:
            r = Round(self.stats.rounds, self.cache.length, root, marg, self.cfg.max_new_tokens - len(self.emitted),
                      len(self.emitted), forward_before=self.stats.forward_seconds,
                      query_before=self.stats.query_tokens)
            self._plan(r)
            self._draft_step(r)
            self._forward_step(r)
            done = self._verify_commit(r)
            root, marg = r.bonus, r.next_marg
            for observe in observers:
                observe(r)
            yield r.committed

    def _finish_oracle(self) -> None:
        for start, cand in self._pending_oracle:
            if start < len(self.emitted):
                self.stats.oracle_lengths.append(oracle_length(cand, self.emitted[start:]))
        self._pending_oracle.clear()


def generate_ids(model, prompt_ids, cfg: DecodeConfig, **kw) -> tuple[list[int], Stats]:
    """All generated ids (prompt excluded) and the stats of the run."""
    dec = Decoder(model, prompt_ids, cfg, **kw)
    out = [t for chunk in dec for t in chunk]
    return out, dec.stats
