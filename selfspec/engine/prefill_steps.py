"""Prompts into the cache: the prefill steps, a field of `step.Stepper` (`stepper.prefills`),
whose forward `bf`, cache, planner and model calls (`timed`, `targets_of`, `group_marginals`,
`lora_rows`) they use; the chunking settings (`piece`, `shares`) and the latest chunk's run
(`last_chunk`) are their own.

A prompt enters whole (`prefill`, `prefill_rest`: groups of rows of similar length in causal
forwards of their own, past `piece` tokens in forwards of `piece` columns) or in chunks while
other rows run (`prefill_chunk`, `chunk_widths`); either way prompts that start alike copy the
K/V of their common prefix from a row holding it (`share_prefixes`) instead of running it again,
and a row whose prompt is in gets its first token (`_first_tokens`: its root, and for one-pass
layouts one mask group for the first round's marginals). The K/V a row writes depend on its own
tokens only (width, batch and chunking aside), so every path writes the same bits.
"""

from __future__ import annotations

import torch

from selfspec.engine.chunks import ChunkRun, prefill_groups, shared_prefixes, token_price
from selfspec.engine.sequence import Sequence


# A prompt longer than this is prefilled in forwards of this many tokens: the exact attention's
# float64 scores of one forward grow with the square of its width (the K/V are bitwise the same).
PREFILL_PIECE = 128


class PrefillSteps:
    """The prefill steps of one stepper (`host`: a `step.Stepper`, read through its public fields)."""

    def __init__(self, host, *, prefill_group: bool):
        self.host = host
        self.prefill_group = prefill_group  # one-pass layouts: the first round's marginals come with the prefill
        self.piece = PREFILL_PIECE
        self.shares = bool(host.bf.ff.exact)  # prompts that start alike share their prefix's K/V (`_share_prefixes`)
        self.last_chunk = None  # the latest chunk's `chunks.ChunkRun`, until the pacing reads it

    def prefill(self, seqs: list[Sequence], slot: int, donors: list | None = None) -> list[list[int]]:
        """The prompts causally into cache rows slot .. slot+k-1 (claimed, `BatchKVCache.claim`:
        empty, or holding the start of their prompt), `_prefill_rows`; then (one-pass layouts) one
        read-only mask group per row for the first round's marginals. Returns each sequence's first
        chunk (one token)."""
        return self._first_tokens(seqs, slot, self._prefill_rows(seqs, slot, donors))

    def prefill_rest(self, seqs: list[Sequence], slot: int, donors: list | None = None) -> tuple[int, list[list[int]]]:
        """What is left of every prompt of `seqs` (cache rows slot.., partly in or not yet) in this
        turn (`_prefill_rows`); each gets its first token as `prefill` gives it. Returns len(seqs)
        and their first chunks."""
        return self.ready(seqs, slot, self._prefill_rows(seqs, slot, donors))

    def _prefill_rows(self, seqs: list[Sequence], slot: int, donors: list | None) -> torch.Tensor:
        """The rest of the prompts of `seqs` (cache rows slot..): first the prefixes they share
        (`_share_prefixes`), then groups of rows of similar length (`chunks.prefill_groups`, priced
        by tokens) in causal forwards of their own, shorter prompts padded
        at their end (the padding's K/V lands past the row's length, never read), past `piece`
        tokens in forwards of `piece` columns each (the K/V bitwise the same: attention sums are
        exact and the weight kernels width-invariant). Returns the hidden state of each row's last
        prompt token [k, H].

        The groups are priced by tokens (`chunks.token_price`) in every mode: priced by plan
        "auto"'s cost model (its steady-state f(rows, width), which overrates a wide forward run
        once), prompts prefilled 8 / 16 at a time took longer in more, narrower forwards, and `auto`
        would prefill slower than AR."""
        self._share_prefixes(seqs, slot, donors or [])
        lengths = self.host.cache.lengths
        last = [None] * len(seqs)
        for a, b in prefill_groups([len(s.prompt) - lengths[slot + i] for i, s in enumerate(seqs)], token_price):
            part = seqs[a:b]
            while any(x is None for x in last[a:b]):
                widths = [max(0, min(self.piece, len(s.prompt) - lengths[slot + a + i])) for i, s in enumerate(part)]
                hidden = self._prefill_forward(part, slot + a, widths)
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
        prefix's K/V (`chunks.shared_prefixes`) from a donor, a row `(row, prompt)` holding part of
        it, or (`own`) from the first of them after it prefilled it once. The K/V of a prefix depend
        on nothing after it, and in the exact formats a row's forward on nothing but its own tokens
        (width, batch and chunking aside), so a copy is bitwise what the row would write itself."""
        if not self.shares:
            return
        lengths = self.host.cache.lengths
        prompts = [s.prompt if lengths[slot + i] == 0 else None for i, s in enumerate(seqs)]
        for donor, src, n, rows in shared_prefixes(prompts, [(r, p[:lengths[r]]) for r, p in donors]):
            if not (donor or own):
                continue
            if not donor:  # one of the rows: it prefills the prefix first
                src = slot + src
                while lengths[src] < n:
                    self._prefill_forward([seqs[src - slot]], src, [min(self.piece, n - lengths[src])])
            for i in rows:
                self.host.cache.copy_prefix(src, slot + i, n)

    def prefill_chunk(self, seqs: list[Sequence], slot: int, budget: int) -> tuple[int, list[list[int]]]:
        """One chunk of a chunked prefill in its own forward: `seqs` hold cache rows slot.. with
        part of their prompts in (the cache row's length: slot = position); the first of them, in
        order, run their next tokens (`chunk_widths`) in one causal forward. The rows whose last
        prompt token is now in get their first token as `prefill` gives it (root from the last
        position's logits, the optional mask group); they are the first n of `seqs`. Returns n and
        their first chunks."""
        widths = self.chunk_widths(seqs, slot, budget)
        taken = seqs[: len(widths)]
        cached = max(self.host.cache.lengths[slot : slot + len(taken)])
        last = self._prefill_forward(taken, slot, widths)
        # what chunk picking learns from
        self.last_chunk = ChunkRun(len(taken), max(widths), cached, self.host.last_seconds)
        return self.ready(taken, slot, last)

    def chunk_widths(self, seqs: list[Sequence], slot: int, budget: int) -> list[int]:
        """The next chunk's tokens per row, for the first rows of `seqs` (cache rows slot..): at
        most `budget` query tokens in all (rows x the widest's tokens); a row takes at most
        `budget` of its prompt, and a row whose prompt does not end in this chunk is the last one
        taken."""
        budget, widths = max(1, int(budget)), []
        for s in seqs:
            left = len(s.prompt) - self.host.cache.lengths[slot + len(widths)]
            w = min(left, budget)
            if widths and (len(widths) + 1) * max(w, max(widths)) > budget:
                break
            widths.append(w)
            if w < left:
                break
        return widths

    def chunk_tokens(self, seqs: list[Sequence], slot: int, widths: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Row slot+i's next `widths[i]` prompt tokens [k, widest] (padded at the end: the padding's
        K/V lands past the row's length and the next chunk or round overwrites it), and the rows'
        lengths before them."""
        k, L, starts = len(seqs), max(widths), self.host.cache.lengths[slot : slot + len(seqs)]
        tokens = torch.zeros(k, L, dtype=torch.long)
        for i, s in enumerate(seqs):
            tokens[i, : widths[i]] = torch.tensor(s.prompt[starts[i] : starts[i] + widths[i]])
        return tokens, starts

    def _prefill_forward(self, seqs: list[Sequence], slot: int, widths: list[int]) -> torch.Tensor:
        """Row slot+i's next `widths[i]` prompt tokens causally at its cache length, in a forward of
        their own; the rows' lengths move past them (`advance`). Returns the hidden state of each
        row's last token written [k, H]."""
        tokens, starts = self.chunk_tokens(seqs, slot, widths)
        k, L = tokens.shape
        hidden = self.host.timed(seqs, lambda: self.host.bf(tokens, torch.arange(L).expand(k, L), self.host.cache,
                                                  slice(slot, slot + k), causal=True))
        return self.advance(seqs, slot, widths, starts, hidden)

    def advance(self, seqs: list[Sequence], slot: int, widths: list[int], starts: list[int],
                 hidden: torch.Tensor) -> torch.Tensor:
        """A chunk's forward ran (`hidden` [k, widest, H]): rows slot..'s lengths move past it.
        Returns the hidden state of each row's last token written [k, H]."""
        for i, s in enumerate(seqs):
            self.host.cache.set_length(slot + i, starts[i] + widths[i])
            s.stats.prefill_forwards += 1
        return hidden[torch.arange(len(seqs)), torch.tensor(widths) - 1]

    def ready(self, seqs: list[Sequence], slot: int, last: torch.Tensor) -> tuple[int, list[list[int]]]:
        """After a chunk (`last` [k, H]: each row's last token written): the rows whose prompts are
        now in, the first n of `seqs`, get their first tokens. Returns n and those."""
        n = sum(self.host.cache.lengths[slot + i] == len(s.prompt) for i, s in enumerate(seqs))  # a prefix of them
        return n, (self._first_tokens(seqs[:n], slot, last[:n]) if n else [])

    def _first_tokens(self, seqs: list[Sequence], slot: int, last: torch.Tensor) -> list[list[int]]:
        """Rows slot.. hold their whole prompts; `last` [k, H]: each one's last prompt position's
        hidden state. Each row's root, then (one-pass layouts, or the planner's bet) one read-only
        mask group per row for the first round's marginals. Returns each one's first chunk."""
        k, L = len(seqs), max(len(s.prompt) for s in seqs)
        rows = slice(slot, slot + k)
        logits = self.host.timed(seqs, lambda: self.host.bf.logits(last))
        for s, t in zip(seqs, self.host.targets_of([(s, logits[i : i + 1], [0]) for i, s in enumerate(seqs)])):
            s.root = int(t[0])
        if self.prefill_group and (self.host.planner is None or self.host.planner.marginals_at_prefill(
                k, L, self.host.cfg.group, max(s.room for s in seqs))):  # the group sits at L .. L+G-1
            G = self.host.cfg.group
            lora, lora_rows = self.host.lora_rows(0)
            masks = torch.full((k, G), self.host.mask_id)
            hidden = self.host.timed(seqs, lambda: self.host.bf(masks, torch.arange(G).expand(k, G), self.host.cache, rows,
                                                                lora=lora, lora_rows=lora_rows))
            for i, s in enumerate(seqs):
                s.stats.prefill_forwards += 1
                s.marg = self.host.group_marginals(s, hidden[i, 1:], at=len(s.emitted) + 1)  # the root comes first
        for s in seqs:  # the prompt's lookup index, as part of its prefill: a first round that read it would pay
            if s.lookup is not None:  # for it, charged to speculation as a lost bet
                s.lookup.catch_up()
        return [s.emit([s.root], self.host.eos) for s in seqs]
