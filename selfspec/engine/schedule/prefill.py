"""Prompts into the cache: the scheduler's prefill (`scheduler.prefill`), nano-vllm's prefill half
of `Scheduler.schedule` with its prefix caching. One object decides which waiting prompts enter,
how much of them a turn prefills, when a chunk runs and which K/V a prompt copies instead of
running; it runs the prefill forwards through the stepper it is given (`step.Stepper`: the
forward, the cache, the clock, the model calls), and it is the one caller of the cache's `claim`,
`retain` and `hold`. The rules it applies are `prefill_rules`; the prices, `round_costs`.

A turn (`enter`, before the round): finished rows leave, waiting prompts take the free rows.
With nothing running they are prefilled whole at once (`whole`: groups of rows of similar length
in causal forwards of their own, past `piece` tokens in forwards of `piece` columns); in a burst
every waiting prompt is (`rest`); else a prompt goes in chunks while the rows run, at most one a
turn: in the round's forward where the format allows it (`ride`: `BatchForward.joins`, one pass
over the weights for both), else in a forward of its own before the round (`run_chunk`, spaced by
`due_chunk`). Either way prompts that start alike copy the K/V of their common prefix from a row
holding it (`share_prefixes`), and a row whose prompt is in gets its first token (`_first_tokens`:
its root, and for one-pass layouts one mask group for the first round's marginals). The K/V a row
writes depend on its own tokens only (width, batch and chunking aside), so every path writes the
same bits.
"""

from __future__ import annotations

import torch

from selfspec.engine.forward.batch_forward import Join
from selfspec.engine.round.rounds import AR
from selfspec.engine.schedule.prefill_rules import (PREFILL_CHUNK, PREFILL_OWN_ROUNDS, PREFILL_PIECE, chunk_due,
                                           kept_prefixes, prefill_first, prefill_groups, shared_prefixes,
                                           whole_prompts)
from selfspec.engine.planning.round_costs import PREFILL_ROUNDS, ChunkRun, ChunkScale, pick_chunk, token_price
from selfspec.engine.request.sequence import Sequence


class Prefill:
    """The prefill of one scheduler's rows (`scheduler`: its waiting, prefilling and live lists,
    read and moved through its methods) on one stepper's forward and cache (`stepper`). `chunk`:
    prompt tokens a turn prefills while rows run (None: priced, `chunk_tokens`); `group`: one-pass
    layouts, whose first round's marginals come with the prefill."""

    def __init__(self, scheduler, stepper, *, chunk: int | None, group: bool):
        self.scheduler, self.stepper = scheduler, stepper
        self.fixed_chunk, self.group = chunk, group
        self.piece = PREFILL_PIECE
        self.shares = bool(stepper.bf.ff.exact)  # prompts that start alike share their prefix's K/V
        self.scale = ChunkScale()  # what this prefill's chunks took over their price
        self.last_chunk = None  # the latest chunk's `round_costs.ChunkRun`, until `chunk_tokens` reads it
        self.since_chunk = 0.0  # own-forward chunks: the rounds' time since the last one
        self.chunk_seconds = 0.0  # and that chunk's own time
        self.chunked = False  # a chunk ran this turn before the round (one chunk a turn)

    @property
    def cache(self):
        return self.stepper.cache

    @property
    def planner(self):
        return self.stepper.planner

    # -- a turn ---------------------------------------------------------------------------------------------
    def enter(self) -> tuple[list, list]:
        """Before the round: finished rows leave, waiting prompts take the free rows (each keeping
        what its row retained of it, `BatchKVCache.claim`). With nothing running they are prefilled
        whole (shortest first: less padding, first tokens sooner) and go live; in a burst
        (`prefill_first`) every waiting prompt is prefilled now; else the entering ones copy what
        they share with a donor and wait for their chunks: one here, in a forward of its own, when
        it is due (`due_chunk`), or one riding in the round (`ride`). Returns the sequences whose
        prompts are in and their first chunks."""
        sched, cache = self.scheduler, self.cache
        sched.retire(cache)  # cancelled since the last turn
        self.chunked = False
        running = bool(sched.live or sched.prefilling)
        entering, slot = sched.admit()
        if entering and self.planner is not None and sched.max_rows == 1:
            self.planner.begin()  # one prompt at a time: each starts its rate and probe clock afresh
        waiting = len(sched.prefilling) + len(entering)
        burst = running and self.fixed_chunk is None and prefill_first(waiting, len(sched.live))
        if not running or burst:
            entering.sort(key=lambda s: len(s.prompt))
        # rows slot.. in this order from here on: a row keeps what it retained only for its own prompt
        cache.claim(slot, slot + len(entering), kept_prefixes(cache.retained, slot, [s.prompt for s in entering]))
        if entering and not running:  # nobody waits for them: the whole prompts at once
            chunks = self.whole(entering, slot, self._donors())
            sched.place(entering, cache)
            return entering, chunks
        if entering and not burst:  # the burst shares below, with the rows that prefill together
            self.share_prefixes(entering, slot, self._donors())
        sched.start_prefill(entering)
        if burst:  # more prompts wait for their first token than rows run: all of them now
            n, chunks = self.rest(sched.prefilling, len(sched.live), self._donors())
            self.chunked = True
            return sched.join(n, cache), chunks
        # the next chunk rides in the round's forward where the format allows (`BatchForward.joins`):
        # its tokens pay their arithmetic, not another pass over the weights
        if sched.prefilling and not (sched.live and self.rides):
            tokens = self.due_chunk()
            if tokens:
                t0 = self.stepper.clock()
                n, chunks = self.run_chunk(sched.prefilling, len(sched.live), tokens)
                entering, self.chunked = sched.join(n, cache), True
                self.since_chunk, self.chunk_seconds = 0.0, self.stepper.clock() - t0  # the rows' share anew
                return entering, chunks
        return [], []

    def ride(self) -> "Ride | None":
        """This turn's chunk in the live rows' round forward (`step.Stepper.step`'s `join`), where
        chunks ride and none ran before the round."""
        if self.scheduler.prefilling and self.rides and not self.chunked:
            return Ride(self, self.chunk_tokens())
        return None

    def after_round(self, rnd) -> tuple[list, list]:
        """The round `rnd` ran: the prompts its riding chunk completed go live, finished rows leave.
        Returns those prompts' sequences and first chunks."""
        sched = self.scheduler
        self.since_chunk += rnd.seconds
        n, chunks = rnd.joined
        entering = sched.join(n, self.cache) if n else []
        sched.retire(self.cache)
        return entering, chunks

    def keep_past(self, tokens: list[int]) -> None:
        """The cache continues a finished generation (`stream(past=...)`): row 0 holds the K/V of its
        `tokens` (`BatchKVCache.hold`) for the prompt that enters it to copy what it starts with."""
        self.cache.hold(0, tokens)

    def retain(self, seqs: list, first: int, free: int) -> None:
        """The finished ones of `seqs` (cache rows first..) leave their K/V to `cache.retain` (rows
        `free`.. are unoccupied): a later prompt that starts alike copies it."""
        for i, s in enumerate(seqs):
            if s.done:
                self.cache.retain(first + i, s.prompt + s.emitted, free)

    def _donors(self) -> list[tuple[int, list[int]]]:
        """Rows whose K/V (as far as each holds it) a prompt entering may copy, `(row, tokens)`: the
        live ones' prompts, those part-way through their prefill, and the free rows that kept a
        finished sequence's tokens (`BatchKVCache.retain`)."""
        sched = self.scheduler
        return [(r, s.prompt) for r, s in enumerate(sched.live + sched.prefilling)] + list(self.cache.retained.items())

    # -- pacing: how much a turn prefills while rows run ----------------------------------------------------
    @property
    def rides(self) -> bool:
        """A waiting prompt's chunk rides in the live rows' round forward (`BatchForward.joins`), where
        something prices it against their round: plan "auto"'s cost model, or a `chunk` the caller
        chose. A fixed mode's default 256-token piece would make every round of the rows a 256-token
        forward: it runs in a forward of its own, spaced (`due_chunk`)."""
        return self.stepper.bf.joins and (self.planner is not None or self.fixed_chunk is not None)

    def due_chunk(self) -> int:
        """The query tokens of the own-forward chunk this turn runs (`chunk_tokens`), 0 for none:
        always with nothing running or a fixed `chunk`; else once the rows have run their share since
        the last one (`prefill_rules.chunk_due`: a long prompt's pieces, under plan "auto" and in the
        fixed modes alike), or at once when it prefills short prompts whole (a free row waiting for
        its prompt is lost time, the chunk costs the same later). Turns that wait between a long
        prompt's pieces price nothing."""
        sched = self.scheduler
        if not sched.live or self.fixed_chunk is not None or chunk_due(self.since_chunk, self.chunk_seconds):
            return self.chunk_tokens()
        if sched.prefilling[0].stats.prefill_forwards:  # the first waiting prompt is part-way in (a copied
            return 0  # prefix, `share_prefixes`, is no chunk of its own)
        tokens = self.chunk_tokens()
        R, lengths, taken = len(sched.live), self.cache.lengths, sched.prefilling
        whole = all(not s.stats.prefill_forwards and w == len(s.prompt) - lengths[R + j]  # from first to last token
                    for j, (s, w) in enumerate(zip(taken, self.chunk_widths(taken, R, tokens))))
        return tokens if whole else 0

    def chunk_tokens(self) -> int:
        """Query tokens this turn's chunked prefill may run: a fixed `chunk` when given; else, with a
        planner (plan "auto"), the largest chunk whose forward (one row, over what the first
        prefilling row holds) costs at most PREFILL_ROUNDS AR rounds of the live rows where it rides
        in their round's forward, PREFILL_OWN_ROUNDS where it runs in its own (spaced), both as
        measured: the planner's AR round time and the cost model's chunk time times what earlier
        chunks took over their prediction (`round_costs.ChunkScale`). At least PREFILL_FLOOR, at most
        the longest prompt part left; else PREFILL_CHUNK."""
        if self.fixed_chunk is not None:
            return self.fixed_chunk
        if self.planner is None:
            return PREFILL_CHUNK
        sched, lengths, cost = self.scheduler, self.cache.lengths, self.planner.costs.cost
        self.planner.settle()  # the AR time below as measured up to this round, resting or not
        last, self.last_chunk = self.last_chunk, None
        if last is not None:
            self.scale.observe(cost, last)
        R = len(sched.live)
        lefts = [len(s.prompt) - lengths[R + j] for j, s in enumerate(sched.prefilling)]
        left = max(lefts, default=1)
        cached = lengths[R] if sched.prefilling else 0
        cache = max(lengths[:R], default=0)
        base = R if R and self.stepper.bf.joins else 0  # a chunk in the round's forward adds to its R query rows
        rounds = PREFILL_OWN_ROUNDS if R and not base else PREFILL_ROUNDS
        ar = self.planner.costs.seconds(AR, max(1, R), cache)[1]
        scale = self.scale.factor
        if R and not base:  # a forward of its own: as many waiting prompts whole as its price allows
            k = whole_prompts(lefts, lambda c: scale * cost(1, c, cached), rounds * ar)
            if k:
                return k * max(lefts[:k])
        return pick_chunk(cost, max(1, R), cache, cached, left, round_seconds=ar, scale=scale, base=base, rounds=rounds)

    # -- the prefill forwards -------------------------------------------------------------------------------
    def whole(self, seqs: list[Sequence], slot: int, donors: list) -> list[list[int]]:
        """The prompts causally into cache rows slot .. slot+k-1 (claimed: empty, or holding the
        start of their prompt), `_rows`; each gets its first token (`_first_tokens`). Returns each
        sequence's first chunk (one token)."""
        return self._first_tokens(seqs, slot, self._rows(seqs, slot, donors))

    def rest(self, seqs: list[Sequence], slot: int, donors: list) -> tuple[int, list[list[int]]]:
        """What is left of every prompt of `seqs` (cache rows slot.., partly in or not yet) in this
        turn (`_rows`); each gets its first token. Returns len(seqs) and their first chunks."""
        return self.ready(seqs, slot, self._rows(seqs, slot, donors))

    def _rows(self, seqs: list[Sequence], slot: int, donors: list) -> torch.Tensor:
        """The rest of the prompts of `seqs` (cache rows slot..): first the prefixes they share
        (`_share_prefixes`), then groups of rows of similar length (`prefill_rules.prefill_groups`)
        in causal forwards of their own, shorter prompts padded at their end (the padding's K/V lands
        past the row's length, never read), past `piece` tokens in forwards of `piece` columns each
        (the K/V bitwise the same: attention sums are exact and the weight kernels width-invariant).
        Returns the hidden state of each row's last prompt token [k, H].

        The groups are priced by tokens (`round_costs.token_price`) in every mode: priced by plan
        "auto"'s cost model (its steady-state f(rows, width), which overrates a wide forward run
        once), prompts prefilled 8 / 16 at a time took longer in more, narrower forwards, and `auto`
        would prefill slower than AR."""
        self._share_prefixes(seqs, slot, donors)
        lengths = self.cache.lengths
        last = [None] * len(seqs)
        for a, b in prefill_groups([len(s.prompt) - lengths[slot + i] for i, s in enumerate(seqs)], token_price):
            part = seqs[a:b]
            while any(x is None for x in last[a:b]):
                widths = [max(0, min(self.piece, len(s.prompt) - lengths[slot + a + i])) for i, s in enumerate(part)]
                hidden = self._forward(part, slot + a, widths)
                for i, s in enumerate(part):
                    if last[a + i] is None and widths[i] and lengths[slot + a + i] == len(s.prompt):
                        last[a + i] = hidden[i]
        return torch.stack(last)

    def share_prefixes(self, seqs: list[Sequence], slot: int, donors: list) -> None:
        """Prompts entering a chunked prefill (cache rows slot.., empty) copy what they share with
        a donor row `(row, prompt)` (`_share_prefixes`), before their first chunk: no forward here,
        a chunk's budget stays its own. Without it a chat prompt joining running rows one at a
        time (a server's requests, a batch whose rows end apart) ran its whole template again."""
        self._share_prefixes(seqs, slot, donors, own=False)

    def _share_prefixes(self, seqs: list[Sequence], slot: int, donors: list, own: bool = True) -> None:
        """Empty rows of `seqs` (cache rows slot..) whose prompts start alike copy their common
        prefix's K/V (`prefill_rules.shared_prefixes`) from a donor, a row `(row, prompt)` holding
        part of it, or (`own`) from the first of them after it prefilled it once. The K/V of a prefix
        depend on nothing after it, and in the exact formats a row's forward on nothing but its own
        tokens (width, batch and chunking aside), so a copy is bitwise what the row would write."""
        if not self.shares:
            return
        lengths = self.cache.lengths
        prompts = [s.prompt if lengths[slot + i] == 0 else None for i, s in enumerate(seqs)]
        for donor, src, n, rows in shared_prefixes(prompts, [(r, p[:lengths[r]]) for r, p in donors]):
            if not (donor or own):
                continue
            if not donor:  # one of the rows: it prefills the prefix first
                src = slot + src
                while lengths[src] < n:
                    self._forward([seqs[src - slot]], src, [min(self.piece, n - lengths[src])])
            for i in rows:
                self.cache.copy_prefix(src, slot + i, n)

    def run_chunk(self, seqs: list[Sequence], slot: int, budget: int) -> tuple[int, list[list[int]]]:
        """One chunk in its own forward: `seqs` hold cache rows slot.. with part of their prompts in;
        the first of them, in order, run their next tokens (`chunk_widths`) in one causal forward.
        The rows whose last prompt token is now in, the first n of `seqs`, get their first tokens.
        Returns n and their first chunks."""
        widths = self.chunk_widths(seqs, slot, budget)
        taken = seqs[: len(widths)]
        cached = max(self.cache.lengths[slot : slot + len(taken)])
        last = self._forward(taken, slot, widths)
        self.last_chunk = ChunkRun(len(taken), max(widths), cached, self.stepper.last_seconds)  # what pacing learns
        return self.ready(taken, slot, last)

    def chunk_widths(self, seqs: list[Sequence], slot: int, budget: int) -> list[int]:
        """The next chunk's tokens per row, for the first rows of `seqs` (cache rows slot..): at
        most `budget` query tokens in all (rows x the widest's tokens); a row takes at most
        `budget` of its prompt, and a row whose prompt does not end in this chunk is the last one
        taken."""
        budget, widths = max(1, int(budget)), []
        for s in seqs:
            left = len(s.prompt) - self.cache.lengths[slot + len(widths)]
            w = min(left, budget)
            if widths and (len(widths) + 1) * max(w, max(widths)) > budget:
                break
            widths.append(w)
            if w < left:
                break
        return widths

    def chunk_ids(self, seqs: list[Sequence], slot: int, widths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Row slot+i's next `widths[i]` prompt tokens [k, widest] (padded at the end: the padding's
        K/V lands past the row's length and the next chunk or round overwrites it), and the rows'
        lengths before them."""
        k, L, starts = len(seqs), max(widths), self.cache.lengths[slot : slot + len(seqs)]
        tokens = torch.zeros(k, L, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : widths[i]] = torch.tensor(s.prompt[starts[i] : starts[i] + widths[i]])
        return tokens, starts

    def _forward(self, seqs: list[Sequence], slot: int, widths: list[int]) -> torch.Tensor:
        """Row slot+i's next `widths[i]` prompt tokens causally at its cache length, in a forward of
        their own (`advance`). Returns the hidden state of each row's last token written [k, H]."""
        tokens, starts = self.chunk_ids(seqs, slot, widths)
        k, L = tokens.shape
        st = self.stepper
        hidden = st.timed(seqs, lambda: st.bf(tokens, torch.arange(L).expand(k, L), st.cache, slice(slot, slot + k),
                                              causal=True))
        return self.advance(seqs, slot, widths, starts, hidden)

    def advance(self, seqs: list[Sequence], slot: int, widths: list[int], starts: list[int],
                hidden: torch.Tensor) -> torch.Tensor:
        """A chunk's forward ran (`hidden` [k, widest, H]): rows slot..'s lengths move past it.
        Returns the hidden state of each row's last token written [k, H]."""
        for i, s in enumerate(seqs):
            self.cache.set_length(slot + i, starts[i] + widths[i])
            s.stats.prefill_forwards += 1
        return hidden[torch.arange(len(seqs)), torch.tensor(widths) - 1]

    def ready(self, seqs: list[Sequence], slot: int, last: torch.Tensor) -> tuple[int, list[list[int]]]:
        """After a chunk (`last` [k, H]: each row's last token written): the rows whose prompts are
        now in, the first n of `seqs`, get their first tokens. Returns n and those."""
        n = sum(self.cache.lengths[slot + i] == len(s.prompt) for i, s in enumerate(seqs))  # a prefix of them
        return n, (self._first_tokens(seqs[:n], slot, last[:n]) if n else [])

    def _first_tokens(self, seqs: list[Sequence], slot: int, last: torch.Tensor) -> list[list[int]]:
        """Rows slot.. hold their whole prompts; `last` [k, H]: each one's last prompt position's
        hidden state. Each row's root, then (one-pass layouts, or the planner's bet) one read-only
        mask group per row for the first round's marginals. Returns each one's first chunk."""
        st, k, L = self.stepper, len(seqs), max(len(s.prompt) for s in seqs)
        rows = slice(slot, slot + k)
        logits = st.timed(seqs, lambda: st.bf.logits(last))
        for s, t in zip(seqs, st.targets_of([(s, logits[i : i + 1], [0]) for i, s in enumerate(seqs)])):
            s.root = int(t[0])
        if self.group and (self.planner is None or self.planner.marginals_at_prefill(
                k, L, st.cfg.group, max(s.room for s in seqs))):  # the group sits at L .. L+G-1
            G = st.cfg.group
            lora, lora_rows = st.lora_rows(0)
            masks = torch.full((k, G), st.mask_id)
            hidden = st.timed(seqs, lambda: st.bf(masks, torch.arange(G).expand(k, G), st.cache, rows,
                                                  lora=lora, lora_rows=lora_rows))
            for i, s in enumerate(seqs):
                s.stats.prefill_forwards += 1
                s.marg = st.group_marginals(s, hidden[i, 1:], at=len(s.emitted) + 1)  # the root comes first
        for s in seqs:  # the prompt's lookup index, as part of its prefill: a first round that read it would pay
            if s.lookup is not None:  # for it, charged to speculation as a lost bet
                s.lookup.catch_up()
        return [s.emit([s.root], st.eos) for s in seqs]


class Ride:
    """A chunk of the prefilling prompts riding in the live rows' round forward, at most `budget`
    query tokens (`Prefill.ride`). The stepper asks it for its part of the forward (`part`: taken
    when the forward runs), tells it what the forward gave (`ran`) and, after the round's own
    steps, takes the first tokens of the prompts it completed (`ready`), all inside the round."""

    def __init__(self, prefill: Prefill, budget: int):
        self.prefill, self.budget = prefill, budget
        self.seqs, self.slot, self.widths, self.starts = [], 0, [], []

    def part(self) -> Join:
        """The chunk's tokens and cache rows for `BatchForward`'s `join` (`chunk_widths`)."""
        p = self.prefill
        waiting, self.slot = p.scheduler.prefilling, len(p.scheduler.live)
        self.widths = p.chunk_widths(waiting, self.slot, self.budget)
        self.seqs = waiting[: len(self.widths)]
        tokens, self.starts = p.chunk_ids(self.seqs, self.slot, self.widths)
        return Join(tokens, slice(self.slot, self.slot + len(self.seqs)))

    def ran(self, hidden: torch.Tensor, *, seconds: float, base: int, round_seconds: float) -> None:
        """The forward ran (`hidden`: the chunk's [k, widest, H]), taking `seconds`, of which
        `round_seconds` predicted for its `base` query tokens of the round: the rows' lengths move
        past the chunk, whose part of the time pacing learns from (`round_costs.ChunkScale`)."""
        self.prefill.last_chunk = ChunkRun(len(self.seqs), max(self.widths), max(self.starts), seconds,
                                           base=base, round_seconds=round_seconds)
        self.last = self.prefill.advance(self.seqs, self.slot, self.widths, self.starts, hidden)

    def ready(self) -> tuple[int, list[list[int]]]:
        """(n, first chunks) of the prompts the chunk completed (the first n), as `run_chunk` gives them."""
        return self.prefill.ready(self.seqs, self.slot, self.last)
