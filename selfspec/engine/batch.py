"""The decoder: rounds over a batch of sequences with ragged acceptance. One prompt is one row.

`BatchDecoder` runs up to `batch_size` sequences (`sequence.Sequence`, one per prompt) through
one batched forward per step (`batch_forward.BatchForward` into a `cache.BatchKVCache`, slot =
position) and yields `(row, chunk)` as rows commit. `decoder.Decoder`, the batch-1 API, is this
code with one row. Each row keeps its own cache length, generator, lookup index and rho; its
drafting, verification (`verify.walk`) and sampling (`sampling.select` with the row's own
generator) run per row, so greedy rows equal their batch-1 output and sampled rows are exact
samples, reproducible per row seed.

Every round starts from the same state per row: the cache row holds the accepted prefix and
`root`, the last emitted token, is not in it yet; `marg` holds marginals for the depths after
the root when the previous round left some (one-pass). A round fills one `rounds.Round` per
row, step by step (`_round`):

1. plan (`_plan`): one layout (`layouts.Option`) for the whole batch: a fixed mode's, or plan
   "auto"'s: with one row the batch-1 planner (`planner.Planner`: AR, lookup chains, PRESTO
   trees two-pass or one-pass, probes), with several the batch planner
   (`batch_planner.BatchPlanner` on f(B, q): AR, lookup chains or two-pass linear drafts);
2. draft (`_draft_step`): two-pass layouts first run [root, M x (B-1)] per row in one batched
   forward; then per row a tree (the root; a copied chain; a linear chain; PRESTO's top-N tree);
3. lay out + forward (`_forward_step`): each row's tree nodes padded to the widest tree (N),
   then its mask groups (one-pass: `tree.group_owners`) padded to the most groups (M x G); a
   padding query sees only itself and no real query sees it; the draft LoRA runs from N on;
4. verify + commit (`_verify_commit`): per row the targets (`sampling.select`), `verify.walk`,
   the next marginals from the endpoint's group or its nearest owner's shifted by the depth gap
   (slot 0 of a group is the bonus position), the accepted path gathered into the row's slots;
5. observe: each row's observers get its finished round (stats, the batch-1 planner, the
   predictor's recorder, the round hook); the batch planner observes the whole round.

Rows that finish (eos inside the accepted span, max_new_tokens) leave; a waiting prompt is
prefilled into the freed cache row (continuous batching), else the last live row moves there.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from selfspec.drafting.sampling import select
from selfspec.drafting.scoring import path_context
from selfspec.drafting.tree import Marginals, chain, group_owners, nearest_owner, root_only, top_nodes
from selfspec.drafting.verify import walk
from selfspec.engine.batch_forward import BatchForward
from selfspec.engine.batch_planner import BatchOption, BatchPlanner
from selfspec.engine.batch_profile import batch_cost_model, is_batch_profile
from selfspec.engine.layouts import AR, Option, config_label, fixed_option
from selfspec.engine.masks import rows_layout
from selfspec.engine.options import DecodeConfig
from selfspec.engine.planner import keep_planner, planner_for
from selfspec.engine.profile import CostProfile
from selfspec.engine.request import check_batch, eos_ids, row_capacity
from selfspec.engine.rounds import Round, recorder_observer, stats_observer
from selfspec.engine.sequence import Sequence, draft_tree, forecast, lookup_chain, new_sequence
from selfspec.engine.stats import Stats


class BatchDecoder:
    """Iterates `(row_index, committed_chunk)` for a batch of prompts; `outputs[i]` / `stats[i]`
    hold row i's ids and measurements (input order). See the module docstring for the round.

    Hooks (None, or set before iterating): `on_round(info)` once per row and round, with the
    dict of `decoder.Decoder`'s contract ("row" is the prompt's index); `recorder(...)` as
    `decoder.Decoder.recorder`, for every row's rounds that verified a tree drafted from marginals.
    """

    def __init__(self, model, prompts_ids, cfg: DecodeConfig, *, batch_size: int | None = None,
                 eos_token_id=None, generators: list[torch.Generator | None] | None = None,
                 seeds: list[int] | None = None, max_cache_bytes: int | None = None, profile=None):
        if generators is not None and seeds is not None:
            raise ValueError("give per-row generators or per-row seeds, not both")
        check_batch(model, prompts_ids, cfg, batch_size, generators if seeds is None else seeds, max_cache_bytes)
        if seeds is not None:
            dev = model.get_input_embeddings().weight.device
            generators = [torch.Generator(device=dev).manual_seed(int(s)) for s in seeds]
        self.model, self.cfg = model, cfg
        self.prompts = [[int(t) for t in p] for p in prompts_ids]
        self.batch_size = min(batch_size or len(self.prompts), len(self.prompts))
        self.eos = eos_ids(model, eos_token_id)
        self.mask_id = int(model.config.mask_token_id)
        self.lora = getattr(model, "draft_lora", None) if cfg.draft_lora else None
        self.bf = BatchForward.of(model)
        self.gens = list(generators) if generators is not None else [None] * len(self.prompts)
        self.outputs: list[list[int]] = [[] for _ in self.prompts]
        self.stats: list[Stats] = [Stats() for _ in self.prompts]
        self.recorder = None
        self.on_round = None
        self.cache = None
        self._model_seconds = 0.0  # every batched forward's time, for the batch planner
        self.planner = self.batch_planner = None
        # plan "auto": one row plans with the batch-1 planner (every layout, on f(q, c)) unless a
        # batch cost profile was given for it; several rows with the batch planner, on f(B, q)
        if cfg.mode == "auto" and self.batch_size == 1 and not is_batch_profile(profile):
            self.planner = planner_for(model, cfg, profile)
        elif cfg.mode == "auto":
            if isinstance(profile, CostProfile):
                raise ValueError("a batch of several rows plans on a batch cost profile (f(B, q), "
                                 "`batch_profile.BatchProfile`); this is a batch-1 cost profile")
            self.batch_planner = BatchPlanner(batch_cost_model(model, profile), lookup_tokens=cfg.lookup_tokens,
                                              block_length=cfg.block_length)
        self.fixed = fixed_option(cfg) if cfg.mode != "auto" else None
        self.fixed_label = config_label(cfg)
        self.prefill_group = self.planner is not None or (self.fixed is not None and self.fixed.groups > 0)
        self.uses_lookup = cfg.mode == "lookup" or (cfg.mode in ("presto", "auto") and cfg.lookup) \
            or self.batch_planner is not None
        self.learned = cfg.mode in ("presto", "auto") and cfg.rho == "learned"
        self.k = cfg.tree_top_k if cfg.mode in ("presto", "auto") else 1

    # -- model calls ------------------------------------------------------------------------------
    def _timed(self, rows: list[Sequence], fn):
        """Model time: added to every row the call served (each waited for all of it)."""
        t0 = time.perf_counter()
        out = fn()
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize(out.device)
        dt = time.perf_counter() - t0
        self._model_seconds += dt
        for s in rows:
            s.stats.forward_seconds += dt
        return out

    def _targets(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return select(logits, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, banned=self.mask_id,
                      generator=seq.gen).cpu()

    def _marginals(self, seq: Sequence, hidden: torch.Tensor) -> Marginals | None:
        if hidden.shape[0] == 0:
            return None
        return self._from_logits(self._timed([seq], lambda: self.bf.logits(hidden)))

    def _from_logits(self, logits: torch.Tensor) -> Marginals:
        """Marginals with the entropy only where it is read (learned rho, the recorder)."""
        return Marginals.from_logits(logits, self.cfg.tree_top_k, self.mask_id,
                                     entropy=self.learned or self.recorder is not None)

    def _new_sequence(self, i: int) -> Sequence:
        if self.planner is not None:  # one row at a time: each prompt starts its rate and probe clock afresh
            self.planner.begin()
        return new_sequence(self.model, self.cfg, i, self.prompts[i], self.gens[i], self.stats[i], self.outputs[i],
                            lookup=self.uses_lookup)

    def _emit(self, seq: Sequence, tokens: list[int]) -> list[int]:
        return seq.emit(tokens, self.eos, self.cfg.max_new_tokens)

    def _prefill(self, rows: list[Sequence], slot: int) -> list[list[int]]:
        """The prompts causally into cache rows slot .. slot+k-1 in one forward (shorter prompts
        padded at their end: the padding's K/V lands past the row's length, never read), then
        (one-pass layouts) one read-only mask group per row for the first round's marginals.
        Returns each row's first chunk (one token)."""
        k, Ls = len(rows), [len(s.prompt) for s in rows]
        L = max(Ls)
        tokens = torch.zeros(k, L, dtype=torch.long)
        for i, s in enumerate(rows):
            tokens[i, : Ls[i]] = torch.tensor(s.prompt)
            self.cache.lengths[slot + i] = 0
        sl = slice(slot, slot + k)
        hidden = self._timed(rows, lambda: self.bf(tokens, torch.arange(L).expand(k, L), self.cache, sl, causal=True))
        last = hidden[torch.arange(k), torch.tensor(Ls) - 1]
        logits = self._timed(rows, lambda: self.bf.logits(last))
        for i, s in enumerate(rows):
            self.cache.lengths[slot + i] = Ls[i]
            s.root = int(self._targets(s, logits[i : i + 1])[0])
            s.stats.prefill_forwards = 1
        if self.prefill_group:  # the group sits at L .. L+G-1: slot 0 is where the first token goes
            G = self.cfg.group
            hidden = self._timed(rows, lambda: self.bf(torch.full((k, G), self.mask_id), torch.arange(G).expand(k, G),
                                                       self.cache, sl, lora=self.lora,
                                                       lora_rows=slice(0, None) if self.lora else None))
            for i, s in enumerate(rows):
                s.stats.prefill_forwards = 2
                s.marg = self._marginals(s, hidden[i, 1:])
        return [self._emit(s, [s.root]) for s in rows]

    def _draft_pass(self, live: list[Sequence]) -> list[Marginals]:
        """[root, M x (B-1)] per row, bidirectional over each row's prefix; read-only (no commit)."""
        B, R = self.cfg.block_length, len(live)
        tokens = torch.full((R, B), self.mask_id)
        tokens[:, 0] = torch.tensor([s.root for s in live])
        hidden = self._timed(live, lambda: self.bf(tokens, torch.arange(B).expand(R, B), self.cache, slice(0, R),
                                                   lora=self.lora, lora_rows=slice(0, None) if self.lora else None))
        logits = self._timed(live, lambda: self.bf.logits(hidden[:, 1:].reshape(R * (B - 1), -1)))
        logits = logits.view(R, B - 1, -1)
        for s in live:
            s.stats.forwards += 1
            s.stats.query_tokens += B
        return [self._from_logits(row) for row in logits]

    # -- a round's steps (each fills its part of every row's `Round`) ------------------------------
    def _plan(self, live: list[Sequence], rounds: list[Round], draining: bool) -> BatchOption | None:
        """One layout for the batch: the fixed mode's, or plan "auto"'s (with what it drafted).
        Returns the batch planner's choice (None for the others); `draining`: no prompt waits."""
        if self.fixed is not None:
            for r in rounds:
                r.option, r.layout = self.fixed, self.fixed_label
            return None
        t0 = time.perf_counter()
        choice = None
        if self.planner is not None:  # one row: the batch-1 planner
            s, r = live[0], rounds[0]
            r.option, drafted = self.planner.plan(lambda: forecast(s, self.cfg, self.planner, r.marg, r.room), r.c,
                                                  r.room, r.marg is not None)
            if isinstance(drafted, list):
                r.drafted, r.match = drafted, s.match
            else:
                r.big = drafted
            r.layout = r.option.label
        else:
            for s, r in zip(live, rounds):
                r.drafted, r.match = lookup_chain(s, self.cfg, r.room), s.match
            drain = [r.room for r in rounds] if draining else None
            choice = self.batch_planner.plan([r.drafted for r in rounds], [r.match for r in rounds],
                                             max(r.room for r in rounds) - 1, drain=drain)
            option = {"ar": AR, "lookup": Option(choice.k, source="lookup"),
                      "two-pass": Option(self.cfg.block_length - 1, draft_pass=True)}[choice.kind]
            for r in rounds:
                r.option, r.layout = option, choice.label
        self._tree_time(live, time.perf_counter() - t0)
        return choice

    def _draft_step(self, live: list[Sequence], rounds: list[Round]) -> None:
        """Every row's tree: a draft pass first (two-pass), then a lookup chain, the planner's
        top-N subtree, or a fresh tree (linear chain / PRESTO) from the marginals."""
        cfg, option = self.cfg, rounds[0].option
        margs = [r.marg for r in rounds]
        if option.draft_pass:
            margs = [None] * len(live)
            if any(r.room > 1 for r in rounds):
                margs = [m if r.room > 1 else None for m, r in zip(self._draft_pass(live), rounds)]
        t0 = time.perf_counter()
        linear = cfg.mode == "linear" or self.batch_planner is not None
        for s, r, marg in zip(live, rounds, margs):
            if option.source == "lookup":
                drafted = (lookup_chain(s, cfg, r.room) if r.drafted is None else r.drafted)[: option.nodes]
                r.match = s.match
                r.tree = chain([r.root] + drafted, torch.zeros(len(drafted) + 1))
            elif r.big is not None and not option.draft_pass:
                r.tree = top_nodes(r.big, option.nodes) if option.nodes else root_only(r.root)
            else:
                r.tree = draft_tree(s, cfg, marg, option.nodes, r.room, linear=linear)
            r.drafted_from = marg
            if self.recorder is not None:
                r.history = tuple(path_context(s.tail(2), [], 2))
            if marg is not None or (self.fixed is not None and cfg.mode not in ("ar", "lookup")):
                cand = torch.zeros(0, 1, dtype=torch.long) if marg is None else marg.top_tok[:, : cfg.tree_top_k]
                s.pending_oracle.append((r.emitted_before, cand))
        if self.batch_planner is not None and option.draft_pass:
            self._cut_chains(rounds)
        self._tree_time(live, time.perf_counter() - t0)

    def _cut_chains(self, rounds: list[Round]) -> None:
        """Batch planner, two-pass: after the pass, every row's chain cut to the one width whose
        calibrated yield per second is best (`BatchPlanner.width_after_draft`)."""
        k = self.batch_planner.width_after_draft(_chains_lq(rounds))
        for r in rounds:
            d = min(k, r.n - 1)
            r.tree = chain(r.tree.tokens[: d + 1].tolist(), r.tree.scores[: d + 1])
            r.layout = BatchOption("two-pass", k).label

    def _forward_step(self, live: list[Sequence], rounds: list[Round]) -> tuple[torch.Tensor, int]:
        """Every row's tree nodes plus mask groups in one forward; each row's targets. Returns the
        hidden states [R, q, H] and the node width N (groups start there)."""
        cfg, R = self.cfg, len(live)
        for r in rounds:
            groups = r.option.groups if r.room > 1 else 0
            r.owners = group_owners(r.tree, groups) if groups else None
            r.group_size = r.option.group_size or cfg.group
        lay = rows_layout([r.tree for r in rounds], [r.owners for r in rounds], rounds[0].group_size, self.mask_id)
        N, q = lay.nodes, lay.tokens.shape[1]
        lora = self.lora if q > N else None  # the draft LoRA on the mask groups, from column N on
        hidden = self._timed(live, lambda: self.bf(lay.tokens, lay.offsets, self.cache, slice(0, R), block=lay.blocks,
                                                   lora=lora, lora_rows=slice(N, None) if lora is not None else None))
        ns = [r.n for r in rounds]
        real = torch.cat([torch.arange(n) + i * q for i, n in enumerate(ns)])
        logits = self._timed(live, lambda: self.bf.logits(hidden.reshape(R * q, -1)[real]))
        start = 0
        for s, r in zip(live, rounds):
            r.logits = logits[start : start + r.n]
            start += r.n
            r.targets = self._targets(s, r.logits)
            s.stats.forwards += 1
            s.stats.query_tokens += q
        return hidden, N

    def _verify_commit(self, slot: int, s: Sequence, r: Round, hidden: torch.Tensor, N: int) -> None:
        """Walk, next marginals (one-pass), commit into the row's cache slots, emit."""
        r.path, r.bonus = walk(r.tree, r.targets)
        if r.owners is not None:
            G = r.group_size
            j, u = nearest_owner(r.tree.parents, r.owners, r.path[-1])
            skip = 1 + int(r.tree.depths[r.path[-1]] - r.tree.depths[u])
            r.next_marg = self._marginals(s, hidden[slot, N + j * G + skip : N + (j + 1) * G])
        self.cache.commit(slot, r.path)
        s.root, s.marg = r.bonus, r.next_marg
        r.committed = self._emit(s, r.tree.tokens[r.path[1:]].tolist() + [r.bonus])
        r.seconds = time.perf_counter() - r.t_start
        r.forward_seconds = s.stats.forward_seconds - r.forward_before
        r.query_tokens = s.stats.query_tokens - r.query_before

    def _observers(self, s: Sequence) -> list:
        """Who reads a row's finished round, in order: stats, the planner, the recorder, the hook."""
        obs = [stats_observer(s.stats)]
        if self.planner is not None:
            obs.append(self.planner.observe)
        if self.recorder is not None:
            obs.append(recorder_observer(self.recorder, self.k, s.rho))
        if self.on_round is not None:
            lam = self.cfg.lam if self.cfg.mode in ("presto", "auto") else 0.0
            hook, top_k, row = self.on_round, self.cfg.tree_top_k, s.index
            obs.append(lambda r: hook({**r.info(lam, top_k), "row": row}))
        return obs

    @staticmethod
    def _tree_time(live: list[Sequence], dt: float) -> None:
        for s in live:
            s.stats.tree_seconds += dt / len(live)

    def _round(self, live: list[Sequence], observers: dict, draining: bool):
        """One round for the live rows (cache rows 0..R-1); yields `(row, chunk)` per row.
        `draining`: no prompt waits for a cache row (the batch ends with its slowest row)."""
        t0 = time.perf_counter()
        f_before = self._model_seconds
        rounds = [Round(s.stats.rounds, self.cache.lengths[i], s.root, s.marg, self.cfg.max_new_tokens - len(s.emitted),
                        len(s.emitted), t_start=t0, forward_before=s.stats.forward_seconds,
                        query_before=s.stats.query_tokens) for i, s in enumerate(live)]
        choice = self._plan(live, rounds, draining)
        self._draft_step(live, rounds)
        hidden, N = self._forward_step(live, rounds)
        for i, (s, r) in enumerate(zip(live, rounds)):
            self._verify_commit(i, s, r, hidden, N)
            for observe in observers[s.index]:
                observe(r)
            yield s.index, r.committed
        if choice is not None:
            self.batch_planner.observe(choice, rows=len(live), width=hidden.shape[1],
                                       seconds=time.perf_counter() - t0, forward_seconds=self._model_seconds - f_before,
                                       tokens=sum(len(r.committed) for r in rounds),
                                       drafted=[r.n - 1 for r in rounds], accepted=[len(r.path) - 1 for r in rounds],
                                       matches=[r.match for r in rounds],
                                       chains_lq=_chains_lq(rounds) if choice.kind == "two-pass" else None)

    # -- the loop ---------------------------------------------------------------------------------
    def __iter__(self):
        self.cache = self.bf.new_cache(self.batch_size, row_capacity(self.prompts, self.cfg, self.batch_size))
        waiting = deque(range(len(self.prompts)))
        live: list[Sequence] = []  # live[s] occupies cache row s
        observers: dict[int, list] = {}
        try:
            while True:
                # free cache rows take waiting prompts, prefilled together (a prompt may finish at
                # its prefill token: the rows after it move up)
                while waiting and len(live) < self.batch_size:
                    rows = [self._new_sequence(waiting.popleft()) for _ in range(min(self.batch_size - len(live),
                                                                                      len(waiting)))]
                    base = len(live)
                    for s, chunk in zip(rows, self._prefill(rows, base)):
                        observers[s.index] = self._observers(s)
                        yield s.index, chunk
                    for slot, s in enumerate(rows, start=base):
                        if not s.done:
                            if slot != len(live):
                                self.cache.move(slot, len(live))
                            live.append(s)
                if not live:
                    return
                yield from self._round(live, observers, draining=not waiting)
                if any(s.done for s in live):
                    live, entered = self._refill(live, waiting)
                    for s, chunk in entered:
                        observers[s.index] = self._observers(s)
                        yield s.index, chunk
        finally:
            for s in live:  # stopped early: what the live rows measured so far
                s.finish()
            if self.planner is not None:
                keep_planner(self.planner)

    def _refill(self, live: list[Sequence], waiting: deque) -> tuple[list[Sequence], list[tuple[Sequence, list[int]]]]:
        """Finished rows leave: a waiting prompt is prefilled into the freed cache row, else the last
        live row moves into it, so the live rows stay cache rows 0..R-1. Returns the live rows and
        the entering rows' first chunks."""
        entered = []
        slots: list[Sequence | None] = [None if s.done else s for s in live]
        for i in range(len(slots)):
            while slots[i] is None and waiting:
                s = self._new_sequence(waiting.popleft())
                entered.append((s, self._prefill([s], i)[0]))
                if not s.done:
                    slots[i] = s
        return self.cache.compact(slots), entered


def _chains_lq(rounds: list[Round]) -> list[torch.Tensor]:
    """Each row's verified chain's per-token log q (two-pass linear drafts; empty without one)."""
    return [torch.zeros(0) if r.drafted_from is None else r.drafted_from.top_lq[: r.n - 1, 0] for r in rounds]


def generate_batch_ids(model, prompts_ids, cfg: DecodeConfig, **kw) -> tuple[list[list[int]], list[Stats]]:
    """Every row's generated ids (prompt excluded) and stats, in input order."""
    dec = BatchDecoder(model, prompts_ids, cfg, **kw)
    for _ in dec:
        pass
    return dec.outputs, dec.stats
