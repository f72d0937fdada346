"""Context index for prompt-lookup drafting: n-gram matches over prompt + emitted tokens.

`ContextIndex` keeps, for every n-gram (min_ngram <= n <= max_ngram) of the context that is
followed by at least one token, where it ends and which tokens follow it. It is a trie over
the context read backwards: the node of an n-gram (a_1 .. a_n) hangs under the node of
(a_2 .. a_n), so one walk from the suffix's last token backwards finds the longest match, and
appending a token touches one node per n (the n-grams that end just before it).

Costs: indexing is O(max_ngram) per appended token (no rescan of the context), paid when the
index is next read (`extend` only appends); `propose` is O(max_ngram + num_tokens + log
occurrences) and `continuations` O(max_ngram + limit).

Which occurrence `propose` copies from. transformers' `PromptLookupCandidateGenerator`
(`generate(prompt_lookup_num_tokens=k)`, default `max_matching_ngram_size=2`) tries n from the
maximum down to 1 and copies the k tokens after the *earliest* (leftmost) occurrence of the
last n tokens that has at least one token after it, cut at the end of the context.
Here n runs the same way (from `max_ngram` down to `min_ngram`; default 3 down to 1), and the
occurrence is:
  * the *most recent* one that still has `num_tokens` tokens after it: the latest copy is the
    one that reflects the latest edits, loop bodies and names, and it is what a recency-biased
    reader (and the emitted text of a model that repeats itself) continues;
  * else, when every occurrence lies closer to the end than that, the earliest one, as
    transformers does: it has the longest continuation (the most recent would cut a periodic
    tail of period P < num_tokens to P tokens, where the earliest copies num_tokens).
So on a context with a single occurrence, or whose occurrences all sit within num_tokens of
the end, the draft equals transformers' (up to its eos and max_length cuts, which the engine
applies itself); they differ only when a full-length continuation exists at several places.

The suffix handed to `propose` / `continuations` may run beyond the indexed context (a tree
path's tokens are not committed yet): only its last max_ngram tokens are read, matches are
looked up in the indexed context, and continuations are read from the indexed context only.
"""

from __future__ import annotations

import gc
from bisect import bisect_right
from collections.abc import Iterable, Sequence

BULK = 512  # appended tokens indexed with the cyclic GC off (`ContextIndex._catch_up`)


class _Node:
    """One n-gram: where it ends in the context and the tokens that follow it.

    `freq` counts successors; `buckets[c]` holds the successors seen c times, oldest last
    occurrence first (a successor's last occurrence is when it entered its bucket), and
    `higher` / `lower` link the non-empty counts, so successors come out most frequent, then
    most recent first without sorting (the O(1) LFU layout). The counts are made when the node's
    successors are first read, from its ends in order (the same steps `add` would have taken):
    indexing a long prompt then costs a list append per n-gram, and the few n-grams a decode asks
    about pay for their own counts (and see `_catch_up`).
    """

    __slots__ = ("kids", "ends", "freq", "buckets", "higher", "lower", "top", "bottom")

    def __init__(self):
        self.kids: dict[int, _Node] | None = None  # made with the first longer n-gram
        self.ends: list[int] = []
        self.freq: dict[int, int] | None = None  # None: not counted yet (then no buckets either)
        self.buckets: dict[int, dict[int, None]] | None = None
        self.higher: dict[int, int] | None = None
        self.lower: dict[int, int] | None = None
        self.top = self.bottom = 0  # highest / lowest non-empty count, 0 = none

    def add(self, end: int, token: int) -> None:
        """Record an occurrence ending at `end` followed by `token`."""
        self.ends.append(end)
        if self.freq is not None:
            self._count(token)

    def _count(self, token: int) -> None:
        c = self.freq.get(token, 0)
        n = c + 1
        self.freq[token] = n
        if n not in self.buckets:  # link the new count right above c (or at the bottom)
            above = self.higher.get(c, 0) if c else self.bottom
            self.buckets[n] = {}
            self.lower[n], self.higher[n] = c, above
            if c:
                self.higher[c] = n
            else:
                self.bottom = n
            if above:
                self.lower[above] = n
            else:
                self.top = n
        self.buckets[n][token] = None
        if c:
            del self.buckets[c][token]
            if not self.buckets[c]:  # unlink the emptied count
                lo, hi = self.lower.pop(c), self.higher.pop(c)
                del self.buckets[c]
                if lo:
                    self.higher[lo] = hi
                else:
                    self.bottom = hi
                self.lower[hi] = lo  # hi >= n exists: the token just moved there

    def successors(self, limit: int, tokens: list[int]) -> list[int]:
        """The distinct successors, most frequent then most recent first; `tokens` the indexed
        context (the successor of an occurrence ending at e is tokens[e + 1])."""
        if self.freq is None:
            self.freq, self.buckets, self.higher, self.lower = {}, {}, {}, {}
            for e in self.ends:
                self._count(tokens[e + 1])
        out: list[int] = []
        c = self.top
        while c and len(out) < limit:
            for t in reversed(self.buckets[c]):
                out.append(t)
                if len(out) == limit:
                    break
            c = self.lower[c]
        return out


class ContextIndex:
    """n-gram index over a growing token context (prompt + emitted tokens).

    Example: ContextIndex([5, 6, 7, 5, 6, 8, 5, 6]) indexes the context; the suffix [.., 5, 6]
    matches the 2-gram (5, 6), which ends at positions 1 and 4 with a token after it:
    `propose([5, 6], 3)` copies from the most recent, -> [8, 5, 6]; `propose([5, 6], 4)` finds no
    occurrence with 4 tokens after it and copies from the earliest, -> [7, 5, 6, 8];
    `continuations([5, 6], 4)` -> [8, 7] (each once, 8 more recent). After `extend([7])`,
    (5, 6) is followed by 7 twice and `continuations([5, 6], 4)` -> [7, 8].
    """

    def __init__(self, tokens: Iterable[int] = (), *, min_ngram: int = 1, max_ngram: int = 3):
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int)) or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need integers 1 <= min_ngram <= max_ngram; got min_ngram={min_ngram}, "
                             f"max_ngram={max_ngram}")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._tokens: list[int] = []
        self._new: list[int] = []  # appended, not indexed yet (`_catch_up`)
        self._root = _Node()
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens) + len(self._new)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens. They are indexed when the index is next read: a decoder appends every
        token it emits, and rounds that look nothing up (AR rounds) should not pay for it."""
        self._new.extend(int(t) for t in tokens)

    def catch_up(self) -> None:
        """Index every appended token now (a decoder indexes a prompt with its prefill, so that no
        round pays for it)."""
        if self._new:
            self._catch_up()

    def _catch_up(self) -> None:
        """Index the appended tokens: each one updates the n-grams (n <= max_ngram) that end just before it.
        A prompt's worth at once (a first lookup over a long context) runs with the cyclic GC off:
        its ~7 objects a token (no cycles among them) would otherwise set off a young collection
        every ~100 tokens."""
        if len(self._new) >= BULK and gc.isenabled():
            gc.disable()
            try:
                self._index_new()
            finally:
                gc.enable()
        else:
            self._index_new()

    def _index_new(self) -> None:
        new, self._new = self._new, []
        ctx, root, top = self._tokens, self._root, self.max_ngram
        lo = self.min_ngram
        for t in new:
            end = len(ctx) - 1  # the n-grams ending here are now followed by t
            node = root
            for j in range(end, max(end - top, -1), -1):
                w = ctx[j]
                kids = node.kids
                if kids is None:
                    kids = node.kids = {}
                kid = kids.get(w)
                if kid is None:
                    kid = kids[w] = _Node()
                node = kid
                if end - j + 1 >= lo:
                    node.add(end, t)
            ctx.append(t)

    def _match(self, suffix: Sequence[int]) -> tuple[_Node | None, int]:
        """(node, n) of the longest n-gram (min_ngram <= n <= max_ngram) ending the suffix; (None, 0)."""
        self.catch_up()
        tail = [int(t) for t in suffix[-self.max_ngram :]]
        node, best, length = self._root, None, 0
        for n, w in enumerate(reversed(tail), 1):
            node = node.kids.get(w) if node.kids else None
            if node is None:
                break
            if n >= self.min_ngram:
                best, length = node, n
        return best, length

    def propose(self, suffix_tokens: Sequence[int], num_tokens: int) -> list[int]:
        """Up to num_tokens tokens that followed the longest match of the suffix's last tokens.

        Empty when no n-gram of the suffix (n >= min_ngram) occurs in the context with a token
        after it, e.g. when the suffix is shorter than min_ngram.
        """
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an integer >= 1; got {num_tokens!r}")
        node = self._match(suffix_tokens)[0]
        if node is None:
            return []
        ends, last = node.ends, len(self._tokens) - 1
        i = bisect_right(ends, last - num_tokens)  # occurrences with num_tokens tokens after them
        e = ends[i - 1] if i else ends[0]
        return self._tokens[e + 1 : e + 1 + num_tokens]

    def match_length(self, suffix_tokens: Sequence[int]) -> int:
        """n of the longest n-gram (min_ngram <= n <= max_ngram) ending the suffix that occurs in
        the context with a token after it; 0 when there is none (what `propose` would copy from)."""
        return self._match(suffix_tokens)[1]

    def continuations(self, suffix_tokens: Sequence[int], limit: int) -> list[int]:
        """The distinct tokens that followed the longest match, most frequent then most recent first."""
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be an integer >= 1; got {limit!r}")
        node = self._match(suffix_tokens)[0]
        return [] if node is None else node.successors(limit, self._tokens)
