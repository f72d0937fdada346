"""Greedy selection is the argmax of the logits with the mask id banned, also where the mask id is
a row's maximum or ties with it, in float32 and in bf16."""

import pytest
import torch

from selfspec.drafting.sampling import ban_token, select

V, MASK = 50, 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_selection_is_the_argmax_without_the_mask_id(dtype):
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[1, MASK] = 100.0  # the mask id is the row's maximum
    logits[2, MASK] = logits[2, 30] = 100.0  # ... tied with a later token
    logits[3, 3] = logits[3, MASK] = 100.0  # ... tied with an earlier one
    got = select(logits, temperature=0.0, banned=MASK)
    assert got.dtype == torch.long and MASK not in got.tolist()
    assert got[2] == 30 and got[3] == 3
    assert torch.equal(got, ban_token(logits, MASK).argmax(-1))
    assert torch.equal(select(logits[[0, 4]], temperature=0.0, banned=MASK), logits[[0, 4]].float().argmax(-1))
    assert torch.equal(select(logits, temperature=0.0), logits.float().argmax(-1))  # nothing banned
