"""All KV-cache surgery lives here.

The cache only ever holds exact causal K/V of accepted tokens. A draft or verification forward
writes K/V for everything it ran; afterwards the runtime either leaves them (a read-only pass)
or keeps an ordered list of offsets (the accepted tree path). Each layer is edited on its own
device, so a model split over several devices needs nothing special.

`BatchKVCache` is the runtime's cache (one row per live sequence; a generation of one prompt has
one): preallocated for the request (and grown when a server's new request needs more slots),
written in place, committed by gathering the accepted rows into place (no per-forward
concatenation, no per-round allocation that grows with the context). Cache lengths change only
through its methods.

A compact cache (the exact formats') holds K and V as int16 mantissas with one shift per token and
key head (`kernels.attn16.compress`), or (the one-byte cache, `kv_cache_dtype="int8"`) int8
mantissas, K's with an integer scale per token and head (int32, `compress_scaled`), V's with a shift;
`write` returns them as they are stored, for the exact attention to read in place; the cache
stores and never attends (`attention.write_attend` runs a narrow round's store and attention in
one C call over its arrays).
"""

from __future__ import annotations

import torch

from selfspec.kernels import attn16

COMPACT = tuple(attn16.SIDES)  # the compact caches' value dtypes (K's and V's side arrays: `attn16.SIDES`)


class BatchKVCache:
    """A batch's K/V: per layer [rows, kv_heads, capacity, head_dim]; row b holds its own prefix in
    slots 0..lengths[b]-1, slot = position (no left padding: rotary positions and cached keys never
    move). A forward writes row b's q new tokens at slots lengths[b] .. lengths[b]+q-1; slots at or
    past a row's length are scratch (a rejected draft, an earlier occupant) and must never be read:
    the batched forward's mask hides them (`engine.batch_forward`).

    Example: lengths [5, 3]; a forward writes 2 tokens per row at slots 5, 6 of row 0 and 3, 4 of
    row 1; commit(1, [0, 1]) keeps both of row 1's (length 5), commit(0, [0]) one of row 0's (6).
    """

    @torch.inference_mode()
    def __init__(self, devices, n_kv: int, head_dim: int, rows: int, capacity: int, dtype: torch.dtype):
        self.devices = list(devices)
        self.shape = (max(1, rows), n_kv, max(1, capacity), head_dim)
        self.dtype = dtype
        self.k = [torch.zeros(self.shape, device=d, dtype=dtype) for d in self.devices]
        self.v = [torch.zeros(self.shape, device=d, dtype=dtype) for d in self.devices]
        # compact (int16 / int8): K's and V's shifts per [row, kv head, slot] (the one-byte cache's K:
        # an integer scale, int32)
        self.shifts = [torch.zeros(self.shape[:3], device=d, dtype=side) for d in self.devices
                       for side in attn16.SIDES[dtype]] if self.block16 else []
        self.lengths = [0] * self.shape[0]
        # free rows that still hold the K/V of a sequence that left (`retain`), row -> its tokens
        # (slots 0..len-1, its length), oldest first; only where `retains` (the exact formats)
        self.retained: dict[int, list[int]] = {}
        self.retains = dtype in COMPACT  # the exact formats' cache: a copied prefix is bitwise the row's own
        # per-request buffers the forward writes (the one-row mask): they live with the request, so
        # generations running in other threads on the same model never see each other's writes
        self.scratch: dict = {}

    @property
    def block16(self) -> bool:
        """K and V as int16 (or int8) with a shift per token and head (the exact formats' cache)."""
        return self.dtype in COMPACT

    def _buffers(self) -> list:
        return [*self.k, *self.v, *self.shifts]

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def capacity(self) -> int:
        return self.shape[2]

    @torch.inference_mode()
    def write(self, layer: int, rows: slice, starts: list[int], k: torch.Tensor, v: torch.Tensor):
        """Store row r's new K/V [R, kv, q, D] at slots starts[r].. and return views [R, kv, S, D]
        of the rows' slots 0..S-1, S = max(starts) + q (the caller's mask hides what a row may not see);
        a compact cache returns (K, shifts) and (V, shifts) views instead (int16 or int8)."""
        q = k.shape[2]
        kb, vb = self.k[layer][rows], self.v[layer][rows]
        end = max(starts) + q
        if end > self.capacity:
            raise RuntimeError(f"batch cache overflow: {end} slots needed, capacity {self.capacity}")
        if self.block16:  # compressed into place, read in place by the exact attention (`kernels.attn16`)
            ksb, vsb = self.shifts[2 * layer][rows], self.shifts[2 * layer + 1][rows]
            attn16.store(k, starts, kb, ksb)
            attn16.store(v, starts, vb, vsb)
            return (kb[:, :, :end], ksb[:, :, :end]), (vb[:, :, :end], vsb[:, :, :end])
        if len(starts) == 1:  # one row: a plain slice, no index tensor
            kb[:, :, starts[0] : end] = k
            vb[:, :, starts[0] : end] = v
        else:
            idx = self._index(starts, k.shape, kb.device)
            kb.scatter_(2, idx, k)
            vb.scatter_(2, idx, v)
        return kb[:, :, :end], vb[:, :, :end]

    def _index(self, starts: list[int], shape, device) -> torch.Tensor:
        """The scatter index of a forward's writes, made once for all its layers (one per device kept)."""
        key = (tuple(starts), tuple(shape))
        memo = self.scratch.get(("index", device))
        if memo is None or memo[0] != key:
            R, kv, q, D = shape
            idx = (torch.tensor(starts, device=device)[:, None] + torch.arange(q, device=device))[:, None, :, None]
            memo = self.scratch[("index", device)] = (key, idx.expand(R, kv, q, D))
        return memo[1]

    def commit(self, row: int, accepted: list[int]) -> None:
        """Keep row `row`'s new tokens at offsets `accepted` (ordered) after its length. Accepted
        tokens that lie in place already (AR, a chain's prefix: most rounds) only move the length."""
        n, start = len(accepted), self.lengths[row]
        if n and list(accepted) != list(range(n)):
            self._gather(row, start, accepted)
        self.lengths[row] = start + n

    @torch.inference_mode()
    def _gather(self, row: int, start: int, accepted: list[int]) -> None:
        n = len(accepted)
        idx = torch.tensor(accepted, dtype=torch.long) + start
        for buf in self._buffers():
            buf[row, :, start : start + n] = buf[row].index_select(1, idx.to(buf.device))

    @torch.inference_mode()
    def move(self, src: int, dst: int, *, keep: bool = False) -> None:
        """Row `src`'s prefix into row `dst` (keeps the live rows contiguous when one leaves);
        keep=True leaves `src` as it was (a copy: rows that share a prefix)."""
        n = self.lengths[src]
        for buf in self._buffers():
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n
        if not keep:
            self.lengths[src] = 0

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Row `src`'s first `n` slots into row `dst`, which then holds those `n` tokens (prompts
        that start alike: the prefix's K/V made once)."""
        if n > self.lengths[src]:
            raise ValueError(f"row {src} holds {self.lengths[src]} tokens, not {n}")
        for buf in self._buffers():
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n

    @torch.inference_mode()
    def retain(self, row: int, tokens: list[int], free: int) -> None:
        """A sequence leaves row `row` (rows `free`.. are unoccupied): its first len(tokens) slots,
        the K/V of `tokens`, are copied into a free row, where a prompt entering later that starts
        alike (the next turn of a chat, the same document asked again) copies them from
        (`prefill.Prefill.share_prefixes`) instead of running them, until a sequence takes that row
        (`claim`). The row: one retained whose tokens the new ones extend, else the highest free
        one not retained, else the one retained longest ago.

        Example: 4 rows, rows 0-1 occupied, row 0's sequence [5, 6, 7] leaves (free=2): row 3 gets
        its 3 slots, retained {3: [5, 6, 7]}; when row 1's [5, 6, 7, 8] leaves, it takes row 3 too."""
        n = min(len(tokens), self.lengths[row])
        if not self.retains or n < 2 or free >= self.rows:
            return
        tokens = list(tokens[:n])
        dst = next((r for r, t in self.retained.items() if tokens[: len(t)] == t), None)
        if dst is None:
            dst = next((r for r in range(self.rows - 1, free - 1, -1) if r not in self.retained), None)
        if dst is None:
            dst = next(iter(self.retained))
        self.retained.pop(dst, None)
        for buf in self._buffers():
            buf[dst, :, :n] = buf[row, :, :n]
        self.lengths[dst] = n
        self.retained[dst] = tokens

    def hold(self, row: int, tokens: list[int]) -> None:
        """Row `row` holds the K/V of `tokens` (as far as its length goes: a finished generation's
        prompt and answer) and keeps them, alone, for the next prompt it is claimed for."""
        n = min(len(tokens), self.lengths[row])
        self.retained = {row: list(tokens[:n])} if self.retains and n >= 2 else {}

    def claim(self, start: int, stop: int, keep: list[int] | None = None) -> None:
        """Rows start..stop-1 are about to hold new sequences: each starts empty, except that row
        start+i keeps its first `keep[i]` slots (what it retained of the prompt entering it,
        `prefill_rules.kept_prefixes`); the prefill starts after them. What they retained is given up."""
        for i, r in enumerate(range(start, stop)):
            self.retained.pop(r, None)
            self.lengths[r] = keep[i] if keep is not None else 0

    def compact(self, occupants: list) -> list:
        """Fill the empty rows (None in `occupants`, one entry per cache row from 0) by moving the
        last occupied rows into them, so the occupied rows are 0..R-1; returns their occupants.
        Example: [a, None, b, None, c] -> c moves from row 4 to row 1 -> [a, c, b]."""
        rows, i = list(occupants), 0
        while i < len(rows):
            if rows[-1] is None:
                rows.pop()
            elif rows[i] is None:
                self.move(len(rows) - 1, i)
                rows[i] = rows.pop()
            else:
                i += 1
        return rows

    def pack(self, live: list, tail: list) -> tuple[list, list]:
        """Two groups of rows: `live` in rows 0..len(live)-1, then `tail` (sequences being
        prefilled in chunks) right after; None marks an empty row in either. The live rows are
        compacted (`compact`), then the tail's occupied rows move down, in order, to follow them
        (a row is only ever moved down, onto a freed or already moved row). Returns both groups'
        occupants. Example: live [a, None], tail [p] (row 2) -> p moves to row 1 -> [a], [p]."""
        n = len(live)
        live = self.compact(live)
        kept = []
        for j, occupant in enumerate(tail):
            if occupant is None:
                continue
            src, dst = n + j, len(live) + len(kept)
            if src != dst:
                self.move(src, dst)
            kept.append(occupant)
        return live, kept

    def reserve(self, capacity: int = 0, rows: int = 0) -> None:
        """At least `rows` rows of `capacity` slots: a larger allocation (capacity doubling, rows
        exactly as asked: a decoder knows its most rows), the rows copied over. Asked every
        forward: the check runs before anything enters inference mode."""
        if capacity > self.capacity or rows > self.rows:
            self._grow(capacity, rows)

    @torch.inference_mode()
    def _grow(self, capacity: int, rows: int) -> None:
        cap = max(capacity, 2 * self.capacity) if capacity > self.capacity else self.capacity
        n = max(rows, self.rows)
        self.shape = (n, self.shape[1], cap, self.shape[3])
        for bufs in (self.k, self.v, self.shifts):
            for i, old in enumerate(bufs):
                new = torch.zeros(self.shape[: old.dim()], device=old.device, dtype=old.dtype)
                new[: old.shape[0], :, : old.shape[2]] = old
                bufs[i] = new
        self.lengths += [0] * (n - len(self.lengths))

    def set_length(self, row: int, n: int) -> None:
        """Row `row` holds `n` committed tokens (after a prefill, or one chunk of it, wrote them:
        a chunked prefill grows a row's length chunk by chunk, slot = position)."""
        self.lengths[row] = n

    @staticmethod
    def nbytes(layers: int, n_kv: int, head_dim: int, rows: int, capacity: int, dtype: torch.dtype) -> int:
        """Bytes such a cache allocates (K and V, every layer, and a compact cache's shifts), for
        checks before allocating."""
        size = lambda t: torch.empty((), dtype=t).element_size()  # noqa: E731
        per_slot = 2 * head_dim * size(dtype) + (sum(size(t) for t in attn16.SIDES[dtype]) if dtype in COMPACT else 0)
        return layers * rows * n_kv * capacity * per_slot
