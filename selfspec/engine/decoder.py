"""The decoding engine: AR, linear and PRESTO drafts, two-pass or one-pass, fixed or planned.

Every round starts from the same state: the KV cache holds the accepted prefix (length c) and
`root`, the last emitted token, is not in the cache yet; `marg` holds diffusion marginals for
the depths after the root when the previous round left some (one-pass) and None otherwise.
A round is a fixed sequence of named steps:

1. layout: `plan="auto"` asks the planner (`planner.Planner`) for this round's `Option`; a
   fixed mode maps to one option every round;
2. draft pass (two-pass only): [root, M x (B-1)] bidirectional over the cache -> marginals;
3. draft: marginals -> a tree rooted at `root` (AR: the root; linear: a chain; PRESTO: the
   top-N tree of `tree.build_tree`);
4. groups (one-pass): which nodes get a mask group (`tree.group_owners`);
5. forward: tree nodes + groups in one call of the compact forward (`forward.FastForward`),
   mask block from `masks.tree_block`, K/V written in place;
6. verify: the target's token after every node (`sampling.select`), `verify.walk`;
7. next marginals (one-pass): the endpoint's group, or its nearest ancestor's shifted by the
   depth gap (slot 0 of a group is the bonus position, filled exactly);
8. commit the accepted path (`cache.KVCache.commit`), emit, bookkeeping (oracle, hooks).
"""

from __future__ import annotations

import time

import torch

from selfspec.engine.calibration import acceptance, local_scores
from selfspec.engine.options import DecodeConfig
from selfspec.engine.forward import FastForward, engine
from selfspec.drafting.lookup import ContextIndex
from selfspec.engine.masks import tree_block
from selfspec.engine.planner import Forecast, Option, config_label, fixed_option, keep_planner, planner_for
from selfspec.engine.stats import Stats
from selfspec.drafting.sampling import select
from selfspec.drafting.scoring import NgramRho, make_extra_score, path_context
from selfspec.drafting.tree import (ContextCandidates, Marginals, Tree, build_tree, chain, group_owners, nearest_owner, root_only,
                   top_nodes)
from selfspec.drafting.verify import oracle_length, truncate, walk


def check_request(model, prompt_ids, cfg: DecodeConfig) -> None:
    """Every request error, raised before any model work."""
    if len(prompt_ids) == 0:
        raise ValueError("empty prompt: at least one token is needed")
    limit = model.config.max_position_embeddings
    need = len(prompt_ids) + cfg.max_new_tokens + lookahead(cfg)
    if need > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({cfg.max_new_tokens}) + draft lookahead "
            f"needs {need} positions; the model has max_position_embeddings={limit}"
        )
    if cfg.rho == "learned" and cfg.mode in ("presto", "auto") and getattr(model, "presto_predictor", None) is None:
        raise ValueError("rho 'learned' needs a trained predictor (presto_predictor.safetensors next to the model; "
                         "make one with `python -m selfspec.training.predictor collect/train`); none is loaded")
    if not FastForward.supports(model):
        raise ValueError("selfspec's engine needs every weight on a device (no offloading to disk or the meta "
                         "device) and no sliding-window attention; this model has one of those")


def lookahead(cfg: DecodeConfig) -> int:
    """Positions a round may use beyond the committed text (draft block, mask group, copied chain)."""
    if cfg.mode == "ar":
        return 0
    if cfg.mode == "lookup":
        return cfg.lookup_tokens
    return max(cfg.block_length, cfg.group, cfg.lookup_tokens if cfg.lookup else 0)


def scratch(cfg: DecodeConfig) -> int:
    """Cache slots a round may write beyond the committed text (every query token of a round)."""
    nodes = cfg.budget if cfg.mode in ("presto", "auto") else cfg.block_length - 1
    return max(cfg.block_length, (nodes + 1) * (cfg.group + 1), cfg.lookup_tokens + 1)


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
        layout             str: "ar", "linear/two-pass", "presto/one-pass/N=32", ... (`planner.config_label`;
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
        eos = eos_token_id if eos_token_id is not None else model.config.eos_token_id
        self.eos = set([eos] if isinstance(eos, int) else (eos or []))
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

    def _forecast(self, root: int, marg: Marginals | None, room: int) -> tuple[Forecast, Tree | None]:
        """The largest tree the planner may pick from, with calibrated acceptance per node."""
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
        return self._tree_forecast(tree), tree

    def _tree_forecast(self, tree: Tree) -> Forecast:
        """P(accepted) of every node of a tree, from its scores through the planner's calibration."""
        prob = self.planner.calibrator.prob(local_scores(tree.scores, tree.parents))
        return Forecast(acceptance(prob, tree.parents), tree.parents, tree.depths, tree.scores)

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

    def _run(self):
        cfg = self.cfg
        self.cache = self.ff.new_cache(len(self.prompt) + cfg.max_new_tokens + scratch(cfg) + 1)
        fixed = None if self.planner is not None else fixed_option(cfg)
        one_pass = self.planner is not None or (fixed.groups > 0)
        root, marg = self._prefill(with_group=one_pass)
        chunk, done = self._emit([root])
        yield chunk
        while not done:
            t_round, f_before, q_before = time.perf_counter(), self.stats.forward_seconds, self.stats.query_tokens
            room = cfg.max_new_tokens - len(self.emitted)  # a path of depth d emits d + 1 tokens
            big, drafted = None, None  # the planner's largest tree, or its lookup drafts
            if fixed is not None:
                option = fixed
            elif self.planner.dormant > 0 and marg is None:  # a run of AR choices: plan again later
                self.planner.dormant -= 1
                option = _AR
            else:
                t0 = time.perf_counter()
                forecast, big = self._forecast(root, marg, room)
                if isinstance(big, list):
                    big, drafted = None, big
                self.stats.tree_seconds += time.perf_counter() - t0
                option, _ = self.planner.choose(forecast, self.cache.length, room)
                self.planner.note_choice(option)
            if option.draft_pass:
                marg = self._draft_pass(root) if room > 1 else None
            t0 = time.perf_counter()
            if option.source == "lookup":
                drafted = (self._lookup_drafts(room) if drafted is None else drafted)[: option.nodes]
                tree = chain([root] + drafted, torch.zeros(len(drafted) + 1))
            elif big is not None and not option.draft_pass:
                tree = top_nodes(big, option.nodes) if option.nodes else root_only(root)
            else:
                tree = self._draft(root, marg, option.nodes, room)
            self.stats.tree_seconds += time.perf_counter() - t0
            if self.planner is not None and option.draft_pass and len(tree) > 1:
                self.planner.observe_two_pass(self._tree_forecast(tree))
            drafted_from = marg  # the marginals this round's tree came from (`marg` moves on below)
            if marg is not None or (fixed is not None and cfg.mode not in ("ar", "lookup")):
                empty = torch.zeros(0, 1, dtype=torch.long)
                self._pending_oracle.append((len(self.emitted), empty if marg is None else marg.top_tok[:, : cfg.tree_top_k]))
            n = len(tree)
            groups = option.groups if room > 1 else 0
            owners = group_owners(tree, groups) if groups else None
            G = option.group_size or cfg.group
            if n == 1 and owners is None:  # AR: one token that sees the prefix, no mask to build
                block, offsets, tokens = None, tree.depths, tree.tokens
            else:
                block, offsets = tree_block(tree.parents, tree.depths, owners, G if owners is not None else 0)
                tokens = torch.cat([tree.tokens, torch.full((block.shape[0] - n,), self.mask_id)])
            hidden = self._forward(tokens, offsets, None if tokens.shape[0] == 1 else block,
                                   draft_from=n if owners is not None else None)
            self.stats.forwards += 1
            self.stats.query_tokens += tokens.shape[0]
            logits = self._head(hidden[:n])
            targets = self._targets(logits)
            path, bonus = walk(tree, targets)
            if self.recorder is not None and marg is not None and n > 1:
                self.recorder(tree, marg.top_lq[:, : self.k], marg.top_tok[:, : self.k], targets, marg.entropy,
                              tuple(path_context(self._tail(2), [], 2)), self.rho, logits)
            if self.planner is not None and n > 1 and option.source == "lookup":
                self.planner.lookup_calibrator.update(n - 1, len(path) - 1, self._match)
            elif self.planner is not None and n > 1:
                on_path = torch.zeros(n, dtype=torch.bool)
                on_path[path] = True
                self.planner.calibrator.update(local_scores(tree.scores, tree.parents), on_path[tree.parents[1:]],
                                               on_path[1:])
            new_marg = None
            if owners is not None:
                j, skip = self._next_marginals_rows(tree, owners, path[-1])
                start = n + j * G + skip
                new_marg = self._marginals(hidden[start : n + (j + 1) * G])
            c = self.cache.length
            self.cache.commit(path)
            root, marg = bonus, new_marg
            self.stats.rounds += 1
            layout = option.label if fixed is None else config_label(cfg)
            self.stats.plan_hist[layout] += 1
            chunk, done = self._emit(tree.tokens[path[1:]].tolist() + [bonus])
            self.stats.accept_lengths.append(len(chunk))
            self.stats.round_tokens += len(chunk)
            if self.planner is not None and option is not _AR:
                self.planner.observe(option, time.perf_counter() - t_round, self.stats.forward_seconds - f_before, c)
            if self.on_round is not None:  # the round hook (contract: the class docstring)
                self.on_round({
                    "round": self.stats.rounds - 1, "c": c, "tree": tree,
                    "cands": None if drafted_from is None else (drafted_from.top_lq, drafted_from.top_tok,
                                                                drafted_from.entropy),
                    "targets": targets, "path": path, "bonus": bonus, "committed": chunk,
                    "layout": layout,
                    "forward_seconds": self.stats.forward_seconds - f_before,
                    "query_tokens": self.stats.query_tokens - q_before,
                    "lam": cfg.lam if cfg.mode in ("presto", "auto") else 0.0,
                    "oracle_candidates": (torch.zeros(0, 1, dtype=torch.long) if drafted_from is None
                                          else drafted_from.top_tok[:, : cfg.tree_top_k])})
            yield chunk

    def _finish_oracle(self) -> None:
        for start, cand in self._pending_oracle:
            if start < len(self.emitted):
                self.stats.oracle_lengths.append(oracle_length(cand, self.emitted[start:]))
        self._pending_oracle.clear()


_AR = Option(0)


def generate_ids(model, prompt_ids, cfg: DecodeConfig, **kw) -> tuple[list[int], Stats]:
    """All generated ids (prompt excluded) and the stats of the run."""
    dec = Decoder(model, prompt_ids, cfg, **kw)
    out = [t for chunk in dec for t in chunk]
    return out, dec.stats
