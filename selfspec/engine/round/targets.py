"""The target's tokens after a round's logits: every row's argmax, or its draw (see
`drafting.sampling`), in as few calls as the rows' settings allow.

Greedy rows of every sequence go through one argmax (bf16 rows in one C pass, cheaper than
torch's); the reproducible rows of each temperature and filter through one
Gumbel-max draw, their noise side by side (`PositionNoise.rows_of`: each sequence's own keyed
positions); an independent draw reads its own sequence's generator, so those go one sequence at a
time. Every step is row by row, so each row's token is the one it gets alone (one call a row
had made a sampled batch's draws a visible share of its round).
"""

from __future__ import annotations

import torch

from selfspec.drafting.sampling import PositionNoise, select
from selfspec.kernels.layer import argmax, gumbel_candidates


def targets_of(parts: list[tuple], mask_id: int) -> list[torch.Tensor]:
    """For each (seq, logits [n, V], its n output positions): the target's token after each row,
    `mask_id` never drawn.

    Example: three sequences, the first and last greedy, the middle one reproducible at T = 1:
    one argmax over the first and last ones' rows, one draw over the middle one's."""
    groups: dict[tuple, list[int]] = {}
    for i, (seq, _, _) in enumerate(parts):
        p = seq.params
        key = (("greedy",) if p.temperature == 0 else
               ("noise", p.temperature, p.top_k, p.top_p) if seq.noise is not None else ("own", i))
        groups.setdefault(key, []).append(i)
    out: list = [None] * len(parts)
    for key, idx in groups.items():
        logits = _stacked([parts[i][1] for i in idx])
        if key[0] == "greedy":
            got = argmax(logits, mask_id).cpu()
        else:
            seq = parts[idx[0]][0]
            p = seq.params
            rand = ({"generator": seq.gen} if key[0] == "own" else
                    {"noise": PositionNoise.rows_of([parts[i][0].noise for i in idx], [parts[i][2] for i in idx])})
            got = select(logits, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, banned=mask_id,
                         candidates=gumbel_candidates, **rand).cpu()
        at = 0
        for i in idx:
            n = parts[i][1].shape[0]
            out[i], at = got[at : at + n], at + n
    return out


def _stacked(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Row blocks [n_i, V] as one [sum n_i, V]: a view where they lie end to end in one tensor (a
    round's rows, sliced in order from its logits), else a copy."""
    first = blocks[0]
    if len(blocks) == 1:
        return first
    size = first.element_size()
    if all(b.is_contiguous() and b.shape[1:] == first.shape[1:] for b in blocks) and all(
            b.data_ptr() == a.data_ptr() + a.numel() * size for a, b in zip(blocks, blocks[1:])):
        return first.as_strided((sum(b.shape[0] for b in blocks), *first.shape[1:]), first.stride())
    return torch.cat(blocks)
