"""Per-sequence values of a decoder, keyed by sequence index, that forget finished sequences."""

from __future__ import annotations

from bisect import bisect_left


class PerSequence(list):
    """A decoder's per-sequence values keyed by sequence index (`Sequence.index`: a batch's input
    order, then the order of `Decoder.add`): `x[i]` is sequence i's, `x[i] = v` sets it (a new
    index is always the largest so far), `del x[i]` drops it (`Decoder.forget`). As a list it holds
    the values of the sequences not forgotten, in index order, so a batch's `outputs == [...]`,
    iteration, `len` and JSON behave as before, and a decoder that has served a million requests
    keeps no slot for any forgotten one. Positional list edits (append, insert, pop, ...) are
    refused: they would lose the keys."""

    __slots__ = ("_keys",)

    def __init__(self, values=()):
        super().__init__(values)
        self._keys = list(range(len(self)))  # sequence index of each value, increasing

    def _pos(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"a sequence index is an int, not {type(i).__name__}")
        keys = self._keys
        p = i if 0 <= i < len(keys) and keys[i] == i else bisect_left(keys, i)  # nothing forgotten before i: p = i
        if p == len(keys) or keys[p] != i:
            raise KeyError(f"no sequence {i} (never added, or forgotten)")
        return p

    def __getitem__(self, i):
        if isinstance(i, slice):  # by position, like the list it is
            return list.__getitem__(self, i)
        return list.__getitem__(self, self._pos(i))

    def __setitem__(self, i: int, value) -> None:
        if self._keys and i <= self._keys[-1]:
            list.__setitem__(self, self._pos(i), value)
        elif isinstance(i, int) and i >= 0:
            self._keys.append(i)
            list.append(self, value)
        else:
            raise KeyError(f"sequence index {i!r}")

    def __delitem__(self, i: int) -> None:
        p = self._pos(i)
        del self._keys[p]
        list.__delitem__(self, p)

    def indices(self) -> list[int]:
        return list(self._keys)

    def _refuse(self, *a, **k):
        raise TypeError("PerSequence is keyed by sequence index: set x[i] or delete x[i]")

    append = extend = insert = pop = remove = sort = reverse = clear = __iadd__ = __imul__ = _refuse
