"""Batched decoding: many prompts at once, each row equal to its batch-1 run.

`BatchDecoder` runs up to `batch_size` rows through one batched forward per step
(`batch_forward.BatchForward`, cache `cache.BatchKVCache`) and yields `(row, chunk)` as rows
commit. Rows accept ragged lengths: each keeps its own cache length, generator, lookup index
and n-gram rho; drafting, verification (`verify.walk`) and sampling (`sampling.select` with the
row's own generator, called exactly as the batch-1 `Decoder` calls it) run per row, so greedy
rows equal their batch-1 output and sampled rows are exact samples, reproducible per row seed.

A round, for the R live rows (cache rows 0..R-1):
1. draft pass (two-pass linear / PRESTO): [root, M x (B-1)] per row, one batched forward;
2. draft: per row, a tree (AR: the root; lookup: the copied chain; linear: a chain; PRESTO: the
   top-N tree) from the draft pass's marginals (two-pass) or the previous round's (one-pass);
3. lay out: each row's tree nodes padded to the widest tree (N), then (one-pass) each row's mask
   groups padded to the most groups (M x G); padding queries see only themselves, no real query
   sees them, and the draft LoRA runs on every row from N on (real groups and padding alike);
4. verify forward, per-row targets and walk, commit each row's path into its own slots; one-pass:
   the next marginals from the endpoint's group (or its nearest owner's), as the batch-1 decoder;
5. rows that finish (eos inside the accepted span, max_new_tokens) leave; a waiting prompt is
   prefilled into the freed cache row (continuous batching), else the last live row moves there.

Modes: "ar", "lookup", and fixed "linear" / "presto", two-pass or one-pass; plan "auto" (mode
"auto"): each round the batch planner (`batch_planner.BatchPlanner`, on the batch cost profile
f(B, q)) picks AR, lookup chains or a two-pass linear draft for all rows, and how many tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from selfspec.drafting.lookup import ContextIndex
from selfspec.drafting.sampling import select
from selfspec.drafting.scoring import NgramRho, make_extra_score, path_context
from selfspec.drafting.tree import (ContextCandidates, Marginals, Tree, build_tree, chain, group_owners, nearest_owner,
                                    root_only)
from selfspec.drafting.verify import truncate, walk
from selfspec.engine.batch_forward import BatchForward, pad_block
from selfspec.engine.batch_planner import BatchOption, BatchPlanner
from selfspec.engine.batch_profile import batch_cost_model
from selfspec.engine.layouts import config_label
from selfspec.engine.request import check_batch, eos_ids, row_capacity
from selfspec.engine.masks import tree_block
from selfspec.engine.options import DecodeConfig
from selfspec.engine.stats import Stats

@dataclass
class _Row:
    index: int
    prompt: list[int]
    gen: torch.Generator | None
    stats: Stats = field(default_factory=Stats)
    emitted: list[int] = field(default_factory=list)
    root: int = -1
    done: bool = False
    index_: ContextIndex | None = None
    rho: NgramRho | None = None
    extra: object = None
    t0: float = 0.0
    marg: Marginals | None = None  # one-pass: the marginals the previous round left

    def tail(self, n: int) -> list[int]:
        e = self.emitted
        return e[-n:] if len(e) >= n else self.prompt[len(self.prompt) - (n - len(e)):] + e


class BatchDecoder:
    """Iterates `(row_index, committed_chunk)` for a batch of prompts; `outputs[i]` / `stats[i]`
    hold row i's ids and measurements (input order). See the module docstring for the round."""

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
        self.mode = cfg.mode
        self.one_pass = self.mode in ("linear", "presto") and cfg.schedule == "one-pass"
        self.prompts = [[int(t) for t in p] for p in prompts_ids]
        self.batch_size = min(batch_size or len(self.prompts), len(self.prompts))
        self.eos = eos_ids(model, eos_token_id)
        self.mask_id = int(model.config.mask_token_id)
        self.lora = getattr(model, "draft_lora", None) if cfg.draft_lora else None
        self.bf = BatchForward.of(model)
        self.gens = list(generators) if generators is not None else [None] * len(self.prompts)
        self.outputs: list[list[int]] = [[] for _ in self.prompts]
        self.stats: list[Stats] = [Stats() for _ in self.prompts]
        self.cache = None
        self._model_seconds = 0.0  # every batched forward's time, for the planner's observations
        self.planner = None
        if self.mode == "auto":
            self.planner = BatchPlanner(batch_cost_model(model, profile), lookup_tokens=cfg.lookup_tokens,
                                        block_length=cfg.block_length)

    # -- per-row pieces ----------------------------------------------------------------------------
    def _new_row(self, i: int) -> _Row:
        cfg, p = self.cfg, self.prompts[i]
        row = _Row(i, p, self.gens[i], self.stats[i], self.outputs[i], t0=time.perf_counter())
        if self.mode in ("lookup", "auto") or (self.mode == "presto" and cfg.lookup):
            row.index_ = ContextIndex(p, min_ngram=cfg.lookup_min_ngram, max_ngram=cfg.lookup_max_ngram)
        if self.mode == "presto":
            row.rho = NgramRho(self.model.config.vocab_size, p) if cfg.rho == "ngram" else None
            row.extra = make_extra_score(row.rho, cfg.lam)
        return row

    def _targets(self, row: _Row, logits: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return select(logits, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p, banned=self.mask_id,
                      generator=row.gen).cpu()

    def _emit(self, row: _Row, tokens: list[int]) -> list[int]:
        """Truncate at eos (inclusive) and at max_new_tokens; marks the row done."""
        out, hit = truncate(tokens, self.eos, self.cfg.max_new_tokens - len(row.emitted))
        row.done = row.done or hit or len(row.emitted) + len(out) >= self.cfg.max_new_tokens
        row.emitted.extend(out)
        row.stats.new_tokens = len(row.emitted)
        if row.rho is not None and out:
            row.rho.extend(out)
        if row.index_ is not None and out:
            row.index_.extend(out)
        if row.done:
            row.stats.seconds = time.perf_counter() - row.t0
        return out

    def _draft(self, row: _Row, marg: Marginals | None, room: int) -> Tree:
        cfg = self.cfg
        if self.mode == "lookup":
            if room <= 1:
                return root_only(row.root)
            drafted = row.index_.propose(row.tail(cfg.lookup_max_ngram), min(cfg.lookup_tokens, room - 1))
            return chain([row.root] + drafted, torch.zeros(len(drafted) + 1))
        if marg is None or room <= 1:
            return root_only(row.root)
        depth = min(len(marg), room - 1)
        if self.mode == "linear":
            lq, tok = marg.top_lq[:depth, 0], marg.top_tok[:depth, 0]
            return chain([row.root] + tok.tolist(), torch.cat([torch.zeros(1), lq.cumsum(0)]))
        tail = row.tail(max(2, cfg.lookup_max_ngram))
        h2 = path_context(tail, [], 2)[0]
        ctx = None
        if cfg.lookup and row.index_ is not None and marg.logq is not None:
            index = row.index_
            ctx = ContextCandidates(lambda path: index.continuations(path, 2), marg.logq,
                                    tuple(tail[-cfg.lookup_max_ngram:]))
        k = cfg.tree_top_k
        return build_tree(row.root, marg.top_lq[:, :k], marg.top_tok[:, :k], budget=cfg.budget,
                          extra_score=row.extra, history=(h2, row.root), max_depth=depth, entropy=marg.entropy,
                          lookup=ctx)

    # -- batched steps ------------------------------------------------------------------------------
    def _timed(self, rows: list[_Row], fn):
        t0 = time.perf_counter()
        out = fn()
        if isinstance(out, torch.Tensor) and out.is_cuda:
            torch.cuda.synchronize(out.device)
        dt = time.perf_counter() - t0
        self._model_seconds += dt
        for r in rows:
            r.stats.forward_seconds += dt
        return out

    def _prefill(self, rows: list[_Row], slot: int) -> list[list[int]]:
        """The prompts causally into cache rows slot .. slot+k-1, in one forward (shorter prompts
        padded at their end: the padding's K/V lands past the row's length, never read); returns
        each row's first chunk (one token)."""
        k, Ls = len(rows), [len(r.prompt) for r in rows]
        L = max(Ls)
        tokens = torch.zeros(k, L, dtype=torch.long)
        for i, r in enumerate(rows):
            tokens[i, : Ls[i]] = torch.tensor(r.prompt)
            self.cache.lengths[slot + i] = 0
        sl = slice(slot, slot + k)
        hidden = self._timed(rows, lambda: self.bf(tokens, torch.arange(L).expand(k, L), self.cache, sl, causal=True))
        last = hidden[torch.arange(k), torch.tensor(Ls) - 1]
        logits = self._timed(rows, lambda: self.bf.logits(last))
        for i, r in enumerate(rows):
            self.cache.lengths[slot + i] = Ls[i]
            r.root = int(self._targets(r, logits[i : i + 1])[0])
            r.stats.prefill_forwards = 1
        if self.one_pass:  # one mask group after each prompt (read-only): the first round's marginals
            G = self.cfg.group
            hidden = self._timed(rows, lambda: self.bf(torch.full((k, G), self.mask_id), torch.arange(G).expand(k, G),
                                                       self.cache, sl, lora=self.lora,
                                                       lora_rows=slice(0, None) if self.lora else None))
            for i, r in enumerate(rows):
                r.stats.prefill_forwards = 2
                r.marg = self._marginals(r, hidden[i, 1:])
        return [self._emit(r, [r.root]) for r in rows]

    def _marginals(self, row: _Row, hidden: torch.Tensor) -> Marginals | None:
        if hidden.shape[0] == 0:
            return None
        logits = self._timed([row], lambda: self.bf.logits(hidden))
        return Marginals.from_logits(logits, self.cfg.tree_top_k, self.mask_id)

    def _draft_pass(self, live: list[_Row]) -> list[Marginals]:
        """[root, M x (B-1)] per row, bidirectional over each row's prefix; read-only (no commit)."""
        B, R = self.cfg.block_length, len(live)
        tokens = torch.full((R, B), self.mask_id)
        tokens[:, 0] = torch.tensor([r.root for r in live])
        hidden = self._timed(live, lambda: self.bf(tokens, torch.arange(B).expand(R, B), self.cache, slice(0, R),
                                                   lora=self.lora, lora_rows=slice(0, None) if self.lora else None))
        logits = self._timed(live, lambda: self.bf.logits(hidden[:, 1:].reshape(R * (B - 1), -1)))
        logits = logits.view(R, B - 1, -1)
        out = []
        for i, r in enumerate(live):
            r.stats.forwards += 1
            r.stats.query_tokens += B
            out.append(Marginals.from_logits(logits[i], self.cfg.tree_top_k, self.mask_id))
        return out

    def _plan(self, live: list[_Row], rooms: list[int]) -> tuple[list[Tree], list, str, dict]:
        """Steps 1-2 of a round: the layout and every row's tree (and mask-group owners).
        Returns (trees, owners, plan_hist label, what `planner.observe` needs)."""
        cfg, R = self.cfg, len(live)
        if self.planner is not None:
            return self._plan_auto(live, rooms)
        margs = [r.marg for r in live] if self.one_pass else [None] * R
        if self.mode in ("linear", "presto") and not self.one_pass and any(room > 1 for room in rooms):
            margs = self._draft_pass(live)
        t0 = time.perf_counter()
        trees = [self._draft(r, m, room) for r, m, room in zip(live, margs, rooms)]
        owners: list[torch.Tensor | None] = [None] * R
        if self.one_pass:
            nodes = cfg.budget if self.mode == "presto" else cfg.block_length - 1
            limit = nodes + 1 if cfg.group_nodes is None else cfg.group_nodes
            owners = [group_owners(t, limit) if room > 1 else None for t, room in zip(trees, rooms)]
        self._tree_time(live, time.perf_counter() - t0)
        return trees, owners, config_label(cfg), {}

    def _plan_auto(self, live: list[_Row], rooms: list[int]) -> tuple[list[Tree], list, str, dict]:
        """plan "auto": the batch planner picks AR, lookup chains or a two-pass linear draft, and
        how many tokens per row (`batch_planner.BatchPlanner`)."""
        cfg, R = self.cfg, len(live)
        t0 = time.perf_counter()
        chains, matches = [], []
        for r, room in zip(live, rooms):
            tail = r.tail(cfg.lookup_max_ngram)
            matches.append(r.index_.match_length(tail))
            chains.append(r.index_.propose(tail, min(cfg.lookup_tokens, room - 1)) if room > 1 else [])
        option = self.planner.plan(chains, matches, max(rooms) - 1)
        self._tree_time(live, time.perf_counter() - t0)
        info = {"option": option, "matches": matches}
        if option.kind == "lookup":
            trees = [chain([r.root] + c[: option.k], torch.zeros(len(c[: option.k]) + 1)) for r, c in zip(live, chains)]
            return trees, [None] * R, option.label, info
        if option.kind != "two-pass":
            return [root_only(r.root) for r in live], [None] * R, "ar", info
        margs = self._draft_pass(live)
        t0 = time.perf_counter()
        lqs = [m.top_lq[: max(0, min(len(m), room - 1)), 0] for m, room in zip(margs, rooms)]
        k = self.planner.width_after_draft(lqs)
        trees = []
        for r, m, lq in zip(live, margs, lqs):
            d = min(k, lq.numel())
            trees.append(chain([r.root] + m.top_tok[:d, 0].tolist(), torch.cat([torch.zeros(1), lq[:d].cumsum(0)])))
        info["chains_lq"] = [lq[:k] for lq in lqs]
        self._tree_time(live, time.perf_counter() - t0)
        return trees, [None] * R, BatchOption("two-pass", k).label, info

    @staticmethod
    def _tree_time(live: list[_Row], dt: float) -> None:
        for r in live:
            r.stats.tree_seconds += dt / len(live)

    def _round(self, live: list[_Row]):
        """One round for the live rows: plan and draft, lay out, forward, then per row verify,
        commit and emit (yielding `(row, chunk)`), then the planner observes."""
        cfg, R = self.cfg, len(live)
        t_round, f_before = time.perf_counter(), self._model_seconds
        rooms = [cfg.max_new_tokens - len(r.emitted) for r in live]
        trees, owners, label, info = self._plan(live, rooms)
        G = cfg.group
        ns = [len(t) for t in trees]
        ms = [0 if o is None else int(o.shape[0]) for o in owners]
        N, M = max(ns), max(ms)
        q = N + M * G
        tokens = torch.full((R, q), self.mask_id)
        offsets = torch.arange(q).repeat(R, 1)  # padding sits at its own slot's position
        blocks = torch.empty(R, q, q)
        for i, t in enumerate(trees):
            block, offs = tree_block(t.parents, t.depths, owners[i], G if owners[i] is not None else 0)
            at = torch.cat([torch.arange(ns[i]), N + torch.arange(ms[i] * G)])  # row i's queries in the layout
            tokens[i, : ns[i]] = t.tokens
            offsets[i, at] = offs
            full = pad_block(torch.zeros(0, 0), q)
            full[at[:, None], at[None, :]] = block
            blocks[i] = full
        lora = self.lora if M else None
        hidden = self._timed(live, lambda: self.bf(tokens, offsets, self.cache, slice(0, R), block=blocks, lora=lora,
                                                   lora_rows=slice(N, None) if lora is not None else None))
        real = torch.cat([torch.arange(n) + i * q for i, n in enumerate(ns)])
        logits = self._timed(live, lambda: self.bf.logits(hidden.reshape(R * q, -1)[real]))
        start, accepted, committed = 0, [], 0
        for i, (r, t) in enumerate(zip(live, trees)):
            targets = self._targets(r, logits[start : start + ns[i]])
            start += ns[i]
            path, bonus = walk(t, targets)
            accepted.append(len(path) - 1)
            if self.one_pass:
                r.marg = None
                if owners[i] is not None:  # the endpoint's group, or its nearest owner's shifted by the depth gap
                    j, u = nearest_owner(t.parents, owners[i], path[-1])
                    skip = 1 + int(t.depths[path[-1]] - t.depths[u])
                    r.marg = self._marginals(r, hidden[i, N + j * G + skip : N + (j + 1) * G])
            self.cache.commit(i, path)
            r.root = bonus
            chunk = self._emit(r, t.tokens[path[1:]].tolist() + [bonus])
            committed += len(chunk)
            st = r.stats
            st.forwards += 1
            st.query_tokens += q
            st.rounds += 1
            st.plan_hist[label] += 1
            st.accept_lengths.append(len(chunk))
            st.round_tokens += len(chunk)
            yield r.index, chunk
        if self.planner is not None:
            self.planner.observe(info["option"], rows=R, width=q, seconds=time.perf_counter() - t_round,
                                 forward_seconds=self._model_seconds - f_before, tokens=committed,
                                 drafted=[n - 1 for n in ns], accepted=accepted, matches=info["matches"],
                                 chains_lq=info.get("chains_lq"))

    # -- the loop -----------------------------------------------------------------------------------
    def __iter__(self):
        self.cache = self.bf.new_cache(self.batch_size, row_capacity(self.prompts, self.cfg))
        waiting = deque(range(len(self.prompts)))
        live: list[_Row] = []  # live[s] occupies cache row s
        while True:
            # fill free cache rows with waiting prompts, prefilled together (a prompt may finish at
            # its prefill token: the rows after it move up)
            while waiting and len(live) < self.batch_size:
                rows = [self._new_row(waiting.popleft()) for _ in range(min(self.batch_size - len(live), len(waiting)))]
                base = len(live)
                for row, chunk in zip(rows, self._prefill(rows, base)):
                    yield row.index, chunk
                for slot, row in enumerate(rows, start=base):
                    if not row.done:
                        if slot != len(live):
                            self.cache.move(slot, len(live))
                        live.append(row)
            if not live:
                return
            yield from self._round(live)
            if any(r.done for r in live):
                live, entered = self._refill(live, waiting)
                for row, chunk in entered:
                    yield row.index, chunk

    def _refill(self, live: list[_Row], waiting: deque) -> tuple[list[_Row], list[tuple[_Row, list[int]]]]:
        """Finished rows leave: a waiting prompt is prefilled into the freed cache row, else the last
        live row moves into it, so the live rows stay cache rows 0..R-1. Returns the live rows and
        the entering rows' first chunks."""
        entered = []
        slots: list[_Row | None] = [None if r.done else r for r in live]
        for s in range(len(slots)):
            while slots[s] is None and waiting:
                row = self._new_row(waiting.popleft())
                entered.append((row, self._prefill([row], s)[0]))
                if not row.done:
                    slots[s] = row
        s = 0
        while s < len(slots):
            if slots[-1] is None:
                slots.pop()
            elif slots[s] is None:
                self.cache.move(len(slots) - 1, s)
                slots[s] = slots.pop()
            else:
                s += 1
        return slots, entered


def generate_batch_ids(model, prompts_ids, cfg: DecodeConfig, **kw) -> tuple[list[list[int]], list[Stats]]:
    """Every row's generated ids (prompt excluded) and stats, in input order."""
    dec = BatchDecoder(model, prompts_ids, cfg, **kw)
    for _ in dec:
        pass
    return dec.outputs, dec.stats
