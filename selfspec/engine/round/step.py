"""One round over the live rows: plan -> draft -> lay out + forward -> verify + commit -> observe.

`Stepper.step(rows)` fills one `rounds.Round` (the option, the forward's widths and hidden
states, one `RowRound` per row) and returns it after every row's observers have read their part:

1. plan: one option for every row (`rounds.Option`): a fixed mode's, or plan "auto"'s
   (`planner.Planner.plan`, which also forecasts what each row can draft);
2. draft: a two-pass option first runs [root, M x (B-1)] per row in one forward (fresh
   marginals); then each row's tree: its lookup chain, the planner's top-N subtree, a linear
   chain or a PRESTO tree from its marginals (`sequence.draft_tree`);
3. lay out + forward: the rows' trees padded to the widest (N), their mask groups (one-pass:
   `tree.group_owners`) after, padding columns that see only themselves
   (`masks.rows_layout`), one forward; the draft LoRA runs on the group columns; the head on
   each row's tree nodes; the rows' targets (`sampling.targets_of`: one argmax or draw for
   rows alike, each row's token the one it gets alone);
4. verify + commit: per row `sampling.walk`; the next marginals from the endpoint's group (or
   its nearest owner's, shifted by the depth gap; slot 0 of a group is the bonus position); the
   accepted path gathered into the row's cache slots (`cache.BatchKVCache.commit`); the tokens
   emitted (eos / max_new_tokens truncation);
5. observe: each row's observers (stats, recorder, round hook), then the planner.

Nothing is committed before its row was verified, and a round reads no state a previous round
left outside the sequences, the cache and the planner. Prompts enter the cache by the scheduler's
prefill (`prefill.Prefill`), which runs its forwards on the stepper and may give a round a chunk
to carry in its forward (`step`'s `join`).
"""

from __future__ import annotations

import time

import torch

from selfspec.drafting.sampling import targets_of, walk
from selfspec.drafting.scoring import path_context
from selfspec.drafting.tree import Marginals, chain, group_owners, nearest_owner, root_only, top_nodes
from selfspec.engine.forward.masks import rows_layout
from selfspec.engine.round.rounds import Round, RowRound
from selfspec.engine.request.sequence import Sequence, draft_tree, lookup_chain


class Stepper:
    """Runs rounds for a decoder: the forward (`bf`), the cache rows, the settings, the plan."""

    def __init__(self, bf, cfg, *, mask_id: int, eos: set[int], lora=None, planner=None, fixed=None,
                 fixed_label: str = ""):
        self.bf, self.cfg, self.mask_id, self.eos, self.lora = bf, cfg, mask_id, eos, lora
        self.planner, self.fixed, self.fixed_label = planner, fixed, fixed_label
        self.cache = None  # the decoder's `cache.BatchKVCache`
        self.recorder = None  # the predictor's recorder, when collecting (needs the marginals' entropy)
        self.learned = cfg.mode in ("presto", "auto") and cfg.rho == "learned"
        self.clock = time.perf_counter  # every time the planner learns from is read here (tests run a fake one)
        self.last_seconds = 0.0  # the latest `timed` call's
        self.replay = None  # `drafting.replay.Replay`: replaced draft marginals (acceptance replay)

    # -- model calls ------------------------------------------------------------------------------------
    def timed(self, seqs: list[Sequence], fn, rnd: Round | None = None):
        """Model time: added to every sequence the call served (each waited for all of it), and kept
        as `last_seconds` (what the chunk picking learns from)."""
        t0 = self.clock()
        out = fn()
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize(out.device)
        dt = self.last_seconds = self.clock() - t0
        if rnd is not None:
            rnd.model_seconds += dt
        for s in seqs:
            s.stats.forward_seconds += dt
        return out

    def targets_of(self, parts: list[tuple]) -> list[torch.Tensor]:
        """The target's token after each row of each (seq, logits, the output positions they stand
        for), all at once (`engine.targets`)."""
        return targets_of(parts, self.mask_id)

    def marginals(self, logits: torch.Tensor, seq: Sequence, at: int, depth: int = 1) -> Marginals:
        """Marginals with the entropy only where it is read (learned rho, the recorder). Row i
        stands for output position `at + i`, `depth + i` tokens after its group's anchor: what a
        replay (the one place the model's marginals are replaced) keys its draws by."""
        marg = Marginals.from_logits(logits, self.cfg.tree_top_k, self.mask_id,
                                     entropy=self.learned or self.recorder is not None)
        if self.replay is None:
            return marg
        t0 = self.clock()
        marg = self.replay.marginals(marg, seq.index, at, depth)
        seq.stats.replay_seconds += self.clock() - t0  # a real drafter never spends it: said apart
        return marg

    def group_marginals(self, seq: Sequence, hidden: torch.Tensor, rnd: Round | None = None, *, at: int,
                        depth: int = 1) -> Marginals | None:
        if hidden.shape[0] == 0:
            return None
        return self.marginals(self.timed([seq], lambda: self.bf.logits(hidden), rnd), seq, at, depth)

    def lora_rows(self, start: int):
        return (self.lora, slice(start, None)) if self.lora is not None else (None, None)

    # -- the round --------------------------------------------------------------------------------------
    def step(self, seqs: list[Sequence], *, draining: bool, observers: dict, join=None) -> Round:
        """One round for the live sequences (cache rows 0..R-1); `observers[seq.index]` read each
        row's part when its tokens are emitted. `join` (`prefill.Ride`, `bf.joins` only): a prompt
        chunk that runs in the round's verification forward; `rnd.joined` then holds (n, first
        chunks) of the prompts it completed (the first n), their first tokens made in the round."""
        t0 = self.clock()
        rows = [RowRound(s, i, s.stats.rounds, self.cache.lengths[i], s.root, s.marg, s.room, len(s.emitted),
                         s.stats.forward_seconds, s.stats.query_tokens) for i, s in enumerate(seqs)]
        rnd = Round(rows, draining, t0)
        self.plan(rnd)
        self.draft(rnd)
        self.forward(rnd, join)
        for r in rows:
            self.verify_commit(r, rnd)
        if join is not None:  # after the round's own steps: the joiners' first tokens are model calls of theirs
            rnd.joined = join.ready()
        rnd.seconds = self.clock() - t0
        for r in rows:
            r.seconds = rnd.seconds
            for observe in observers[r.seq.index]:
                observe(r, rnd)
        if self.planner is not None:
            self.planner.observe(rnd)
            # the planner's learning (and the observers before it) ran after the round's clock
            # stopped: planner time too, which AR mode does not spend; the next round pays it
            self.planner.trailing += self.clock() - t0 - rnd.seconds
        return rnd

    def plan(self, rnd: Round) -> None:
        if self.fixed is not None:
            rnd.option, rnd.layout = self.fixed, self.fixed_label
            return
        t0 = self.clock()
        rnd.option = self.planner.plan(rnd)
        rnd.layout = rnd.option.label
        rnd.plan_seconds = self.clock() - t0
        self._tree_time(rnd, rnd.plan_seconds)

    def draft(self, rnd: Round) -> None:
        """Every row's tree: a draft pass first (two-pass), then a lookup chain, the planner's
        top-N subtree, or a fresh tree (linear chain / PRESTO) from the marginals."""
        cfg, option = self.cfg, rnd.option
        margs = [r.marg for r in rnd.rows]
        if option.draft_pass:
            margs = [None] * len(rnd.rows)
            if any(r.room > 1 for r in rnd.rows):
                margs = [m if r.room > 1 else None for m, r in zip(self._draft_pass(rnd), rnd.rows)]
        t0 = self.clock()
        for r, marg in zip(rnd.rows, margs):
            s = r.seq
            if option.draft == "lookup":
                drafted = (lookup_chain(s, cfg, r.room) if r.drafted is None else r.drafted)[: option.nodes]
                r.tree = chain([r.root] + drafted, torch.zeros(len(drafted) + 1))
            elif r.big is not None and not option.draft_pass:
                r.tree = top_nodes(r.big, option.nodes) if option.nodes else root_only(r.root)
            else:
                r.tree = draft_tree(s, cfg, marg, option.nodes, r.room, linear=option.draft == "chain")
            r.drafted_from = marg
            if self.recorder is not None:
                r.history = tuple(path_context(s.tail(2), [], 2))
            if marg is not None or (self.fixed is not None and cfg.mode not in ("ar", "lookup")):
                cand = torch.zeros(0, 1, dtype=torch.long) if marg is None else marg.top_tok[:, : cfg.tree_top_k]
                s.pending_oracle.append((r.emitted_before, cand))
        self._tree_time(rnd, self.clock() - t0)

    def _draft_pass(self, rnd: Round) -> list[Marginals]:
        """[root, M x (B-1)] per row, bidirectional over each row's prefix; read-only (no commit)."""
        B, R, seqs = self.cfg.block_length, len(rnd.rows), [r.seq for r in rnd.rows]
        tokens = torch.full((R, B), self.mask_id)
        tokens[:, 0] = torch.tensor([r.root for r in rnd.rows])
        lora, lora_rows = self.lora_rows(0)
        hidden = self.timed(seqs, lambda: self.bf(tokens, torch.arange(B).expand(R, B), self.cache, slice(0, R),
                                                  lora=lora, lora_rows=lora_rows), rnd)
        logits = self.timed(seqs, lambda: self.bf.logits(hidden[:, 1:].reshape(R * (B - 1), -1)), rnd)
        logits = logits.view(R, B - 1, -1)
        for s in seqs:
            s.stats.forwards += 1
            s.stats.query_tokens += B
        return [self.marginals(row, s, len(s.emitted)) for row, s in zip(logits, seqs)]

    def forward(self, rnd: Round, join=None) -> None:
        """Every row's tree nodes plus mask groups in one forward (padded to the option's width);
        each row's node logits and targets. `join`: a prompt chunk in the same forward (`step`),
        told what the forward gave it."""
        o, R, seqs = rnd.option, len(rnd.rows), [r.seq for r in rnd.rows]
        G = o.group_size or self.cfg.group
        for r in rnd.rows:
            groups = o.groups if r.room > 1 else 0
            r.owners = group_owners(r.tree, groups) if groups else None
        lay = rows_layout([r.tree for r in rnd.rows], [r.owners for r in rnd.rows], G, self.mask_id, width=o.pad_to)
        N, q = lay.nodes, lay.tokens.shape[1]
        rnd.nodes_width, rnd.width = N, q
        lora, lora_rows = self.lora_rows(N) if q > N and any(r.owners is not None for r in rnd.rows) else (None, None)
        if join is None:
            rnd.hidden = self.timed(seqs, lambda: self.bf(lay.tokens, lay.offsets, self.cache, slice(0, R),
                                                          block=lay.blocks, lora=lora, lora_rows=lora_rows), rnd)
        else:
            part = join.part()
            rnd.hidden, chunk = self.timed(seqs + join.seqs, lambda: self.bf(
                lay.tokens, lay.offsets, self.cache, slice(0, R), block=lay.blocks, lora=lora, lora_rows=lora_rows,
                join=part), rnd)
            rnd.join_tokens = int(part.tokens.numel())
            # the chunk's part: the forward beyond the round's own predicted time (`round_costs.ChunkScale`)
            own = self.planner.costs.model_seconds(o.family, R, q, rnd.cache_len) if self.planner is not None else 0.0
            join.ran(chunk, seconds=self.last_seconds, base=R * q, round_seconds=own)
        if q == 1:  # one node a row: every column is real
            logits = self.timed(seqs, lambda: self.bf.logits(rnd.hidden.reshape(R, -1)), rnd)
        else:
            real = torch.cat([torch.arange(len(r.tree)) + i * q for i, r in enumerate(rnd.rows)])
            logits = self.timed(seqs, lambda: self.bf.logits(rnd.hidden.reshape(R * q, -1)[real]), rnd)
        start, t0 = 0, self.clock()
        for r in rnd.rows:
            r.logits = logits[start : start + len(r.tree)]
            start += len(r.tree)
            r.seq.stats.forwards += 1
            r.seq.stats.query_tokens += q
        got = self.targets_of([(r.seq, r.logits, [d + r.emitted_before for d in r.tree.depths.tolist()])
                               for r in rnd.rows])
        for r, t in zip(rnd.rows, got):
            r.targets = t
        rnd.target_seconds, rnd.target_rows = self.clock() - t0, start

    def verify_commit(self, r: RowRound, rnd: Round) -> None:
        """Walk, next marginals (one-pass), commit into the row's cache slots, emit."""
        s = r.seq
        r.path, r.bonus = walk(r.tree, r.targets)
        if r.owners is not None:
            G, N = rnd.option.group_size or self.cfg.group, rnd.nodes_width
            j, u = nearest_owner(r.tree.parents, r.owners, r.path[-1])
            skip = 1 + int(r.tree.depths[r.path[-1]] - r.tree.depths[u])
            r.next_marg = self.group_marginals(s, rnd.hidden[r.slot, N + j * G + skip : N + (j + 1) * G], rnd,
                                               at=r.emitted_before + len(r.path), depth=skip)
        self.cache.commit(r.slot, r.path)
        s.root, s.marg = r.bonus, r.next_marg
        tokens = r.tree.tokens.tolist()
        r.committed = s.emit([tokens[v] for v in r.path[1:]] + [r.bonus], self.eos)
        r.forward_seconds = s.stats.forward_seconds - r.forward_before
        r.query_tokens = s.stats.query_tokens - r.query_before

    @staticmethod
    def _tree_time(rnd: Round, dt: float) -> None:
        for r in rnd.rows:
            r.seq.stats.tree_seconds += dt / len(rnd.rows)
