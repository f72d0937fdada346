"""Greedy selection is the argmax of the logits with the mask id banned, also where the mask id is
a row's maximum or ties with it, in float32 and in bf16; the C pass the engine runs on bf16 rows
(`kernels.layer.argmax`) gives the same index as torch in every such row, and with NaNs, signed
zeros and rows of -inf, in rows as wide as the vocabulary too."""

import pytest
import torch

from selfspec.drafting.sampling import ban_token, select
from selfspec.kernels import layer

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


def _awkward_rows() -> torch.Tensor:
    x = torch.randn(10, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    x[0, MASK] = 100.0  # the mask id is the maximum
    x[1, MASK] = x[1, 250] = 100.0  # tied with a later token, in another block of the C pass
    x[2, 3] = x[2, MASK] = 100.0  # tied with an earlier one
    x[3] = float("-inf")  # nothing but -inf: index 0, as torch
    x[4] = 0.0
    x[4, :5] = -0.0  # -0 == +0: the first zero
    x[5, 120] = float("nan")  # torch: the NaN's index
    x[6, MASK] = float("nan")  # a NaN at the mask id is banned away
    x[7, 299] = 100.0  # the last index
    x[8, :] = -1.0
    x[8, 0] = -0.5  # the first index
    x.view(torch.int16)[9, 60] = -64  # 0xffc0: a NaN with its sign bit set is a NaN too
    assert x[9, 60].isnan()
    return x


@pytest.mark.skipif(not layer.available(), reason="no C compiler: the torch twin runs")
@pytest.mark.parametrize("banned", [MASK, 0, None])
def test_the_c_argmax_of_bf16_rows_is_torchs(banned):
    x = _awkward_rows()
    got = layer.argmax(x, banned)
    assert torch.equal(got, layer.argmax(x, banned, fallback=True)), got
    want = select(x, temperature=0.0, banned=banned)
    assert torch.equal(got, want), (got, want)
    big = torch.randn(4, 49152, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(layer.argmax(big, banned), select(big, temperature=0.0, banned=banned))


def _wide_awkward_rows() -> torch.Tensor:
    """Rows as wide as the default model's vocabulary."""
    W = 49152
    x = torch.randn(9, W, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[0, 10] = x[0, 40000] = 100.0  # tied far apart: the first
    x[1, MASK] = 100.0
    x[1, 30000] = 50.0  # the mask id is the maximum: the next one, far from it
    x[2] = float("-inf")  # nothing but -inf: index 0
    x[3] = float("-inf")
    x[3, MASK] = 1.0  # ... and the only finite value banned
    x[4, 45000] = float("nan")
    x[5, W - 1] = 100.0  # the last index
    x[6] = 0.0
    x[6, :3] = -0.0
    x[7, 24575] = x[7, 24576] = 100.0  # tied in neighbouring blocks of the C pass
    return x


@pytest.mark.skipif(not layer.available(), reason="no C compiler: the torch twin runs")
@pytest.mark.parametrize("banned", [MASK, 24575, None])
def test_the_c_argmax_of_rows_as_wide_as_the_vocabulary_is_torchs(banned):
    x = _wide_awkward_rows()
    assert torch.equal(layer.argmax(x, banned), select(x, temperature=0.0, banned=banned))


@pytest.mark.skipif(not layer.available(), reason="no C compiler: the torch twin runs")
@pytest.mark.parametrize("banned", [MASK, 24575, 24576, None])
def test_a_lone_row_cut_in_halves_over_two_threads_answers_as_torch(banned):
    """A row alone is searched in two halves at once: ties across the cut (24575 | 24576), the
    maximum banned in either half, all -inf and NaN rows keep torch's first index."""
    x = _wide_awkward_rows()
    x[8] = -1.0
    x[8, 24576] = x[8, 24575] = 3.0  # tied right at the cut: the first half's
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for r in range(x.shape[0]):
                row = x[r : r + 1]
                want = select(row, temperature=0.0, banned=banned)
                assert torch.equal(layer.argmax(row, banned), want), (threads, r)
                # the C pass itself, not torch after it: only the NaN row is handed back
                out = torch.empty(1, dtype=torch.long)
                fn = layer._c(False, "sample_argmax_bf16", row)
                nans = fn(row.data_ptr(), 1, row.shape[1], -1 if banned is None else banned, out.data_ptr(), threads)
                assert (nans, int(out[0])) == ((1, -1) if row.isnan().any() else (0, int(want[0]))), (threads, r)
    finally:
        torch.set_num_threads(before)
