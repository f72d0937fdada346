"""How much of the waiting prompts a decoder's turn prefills while rows run: the chunk's query
tokens (`chunk_tokens`: fixed, or priced by plan "auto"'s cost model against the live rows' AR
round) and, for a chunk in a forward of its own, whether this turn runs one (`due_chunk`: a long
prompt's pieces come spaced, short prompts go at once). `engine.decoder.Decoder` holds one
(`decoder.pacing`); the pure pricing rules are in `engine.chunks`.
"""

from __future__ import annotations

from selfspec.engine.chunks import (PREFILL_CHUNK, PREFILL_OWN_ROUNDS, PREFILL_ROUNDS, ChunkScale, chunk_due,
                                    pick_chunk, whole_prompts)
from selfspec.engine.layouts import AR


class PrefillPacing:
    """A decoder's chunk pacing: `prefill_chunk` (None: priced), the decoder's forward `bf` (whether
    a chunk can ride, `BatchForward.joins`), scheduler and stepper (read, never written, but for the
    stepper's `last_chunk`, taken once read), and the chunk clock it keeps itself (`ran_chunk`,
    `ran_round`)."""

    def __init__(self, *, prefill_chunk: int | None, bf, scheduler, stepper):
        self.prefill_chunk = prefill_chunk
        self.bf, self.scheduler, self.stepper = bf, scheduler, stepper
        self.scale = ChunkScale()  # what this decoder's chunks took over their price
        self.since_chunk = 0.0  # own-forward chunks: the rounds' time since the last one
        self.chunk_seconds = 0.0  # and that chunk's own time

    @property
    def planner(self):
        return self.stepper.planner

    def ran_chunk(self, seconds: float) -> None:
        """An own-forward chunk ran, taking `seconds`: the rows' share starts again."""
        self.since_chunk, self.chunk_seconds = 0.0, seconds

    def ran_round(self, seconds: float) -> None:
        self.since_chunk += seconds

    @property
    def rides(self) -> bool:
        """A waiting prompt's chunk rides in the live rows' round forward (`BatchForward.joins`), where
        something prices it against their round: plan "auto"'s cost model, or a `prefill_chunk` the
        caller chose. A fixed mode's default 256-token piece would make every round of the rows a
        256-token forward: it runs in a forward of its own, spaced (`due_chunk`)."""
        return self.bf.joins and (self.planner is not None or self.prefill_chunk is not None)

    def due_chunk(self) -> int:
        """The query tokens of the own-forward chunk this turn runs (`chunk_tokens`), 0 for none:
        always with nothing running or a fixed `prefill_chunk`; else once the rows have run their
        share since the last one (`chunks.chunk_due`: a long prompt's pieces, under plan "auto" and
        in the fixed modes alike: a 256-token piece every turn had stalled the running rows while a
        long prompt joined), or at once when it prefills short
        prompts whole (a free row waiting for its prompt is lost time, the chunk costs the same
        later). Turns that wait between a long prompt's pieces price nothing."""
        sched = self.scheduler
        if not sched.live or self.prefill_chunk is not None or chunk_due(self.since_chunk, self.chunk_seconds):
            return self.chunk_tokens()
        if sched.prefilling[0].stats.prefill_forwards:  # the first waiting prompt is part-way in (a copied
            return 0  # prefix, `share_prefixes`, is no chunk of its own)
        tokens = self.chunk_tokens()
        return tokens if self._whole(tokens) else 0

    def _whole(self, tokens: int) -> bool:
        """Whether a chunk of `tokens` prefills every prompt it takes in one go: from its first token
        (or the end of the prefix it copied) to its last."""
        R, lengths = len(self.scheduler.live), self.stepper.cache.lengths
        taken = self.scheduler.prefilling
        widths = self.stepper.prefills.chunk_widths(taken, R, tokens)
        return all(not s.stats.prefill_forwards and w == len(s.prompt) - lengths[R + j]
                   for j, (s, w) in enumerate(zip(taken, widths)))

    def chunk_tokens(self) -> int:
        """Query tokens this turn's chunked prefill may run: `prefill_chunk` when given; else, with a
        planner (plan "auto"), the largest chunk whose forward (one row, over what the first
        prefilling row holds) costs at most PREFILL_ROUNDS AR rounds of the live rows where it rides
        in their round's forward, PREFILL_OWN_ROUNDS where it runs in its own (spaced), both as
        measured: the planner's AR round time (its cost model times the AR rounds' measured scale,
        plus their overhead) and the cost model's chunk time times what earlier chunks took over
        their prediction (a cost model's cache axis ends at 1,024 tokens; a long prompt's chunks
        run past it). At least PREFILL_FLOOR, at most the longest prompt part left; else PREFILL_CHUNK."""
        if self.prefill_chunk is not None:
            return self.prefill_chunk
        if self.planner is None:
            return PREFILL_CHUNK
        sched, lengths, cost = self.scheduler, self.stepper.cache.lengths, self.planner.costs.cost
        self.planner.settle()  # the AR time below as measured up to this round, resting or not
        prefills = self.stepper.prefills
        last, prefills.last_chunk = prefills.last_chunk, None
        if last is not None:
            self.scale.observe(cost, last)
        R = len(sched.live)
        lefts = [len(s.prompt) - lengths[R + j] for j, s in enumerate(sched.prefilling)]
        left = max(lefts, default=1)
        cached = lengths[R] if sched.prefilling else 0
        cache = max(lengths[:R], default=0)
        base = R if R and self.bf.joins else 0  # a chunk in the round's forward adds to its R query rows
        rounds = PREFILL_OWN_ROUNDS if R and not base else PREFILL_ROUNDS
        ar = self.planner.costs.seconds(AR, max(1, R), cache)[1]
        scale = self.scale.factor
        if R and not base:  # a forward of its own: as many waiting prompts whole as its price allows
            k = whole_prompts(lefts, lambda c: scale * cost(1, c, cached), rounds * ar)
            if k:
                return k * max(lefts[:k])
        return pick_chunk(cost, max(1, R), cache, cached, left, round_seconds=ar, scale=scale, base=base, rounds=rounds)
