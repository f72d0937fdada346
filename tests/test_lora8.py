"""The draft LoRA's int8 kernel (`kernels/lora8.h`): its own calls, the one-call block's matmul that
carries it, and every vector path, against the torch twin (`w4a8.lora(fallback=True)`)."""

import ctypes

import pytest
import torch

from selfspec.kernels import build, w4a8
from test_w4a8 import BUILDS, _cpu_flags, needs_kernel


def _tables(k, r, n, seed):
    g = torch.Generator().manual_seed(seed)
    return w4a8.pack_lora(torch.randn(r, k, generator=g) * 0.1, torch.randn(n, r, generator=g) * 0.1)


def _inputs(m, k, n, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16), torch.randn(m, n, generator=g).to(torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("k, r, n", [(576, 48, 960), (1536, 16, 576), (100, 3, 70), (64, 64, 130), (576, 33, 40)])
def test_the_draft_loras_delta_gives_the_twins_bits_on_its_rows_only(k, r, n):
    a, b = torch.randn(r, k) * 0.1, torch.randn(n, r) * 0.1
    a8, b8 = w4a8.pack_lora(a, b)
    x, out = _inputs(9, k, n, k + r)
    rows = torch.tensor([0, 3, 4, 8])
    c, twin = out.clone(), out.clone()
    w4a8.lora(x, a8, b8, c, rows)
    w4a8.lora(x, a8, b8, twin, rows, fallback=True)
    assert torch.equal(c, twin)
    assert torch.equal(c[[1, 2, 5, 6, 7]], out[[1, 2, 5, 6, 7]])
    delta = (x[rows].float() @ a.T) @ b.T  # the fp32 LoRA: within the int8 grids' steps
    assert (c[rows].float() - out[rows].float() - delta).abs().max() < 0.05 * delta.abs().max() + 0.02


@needs_kernel
@pytest.mark.parametrize("r", [16, 32, 48, 64])
@pytest.mark.parametrize("n_rows", [1, 2, 3, 7, 8, 9, 17, 20])
def test_the_draft_loras_delta_gives_the_twins_bits_at_every_row_count(r, n_rows):
    """Rows go through the tiles 8 at a time (4 on AVX2): every row count, rows out of order, a
    last tile of fewer than 16 columns."""
    a8, b8 = _tables(576, r, 1000, r + n_rows)
    x, out = _inputs(24, 576, 1000, n_rows)
    rows = torch.randperm(24, generator=torch.Generator().manual_seed(r))[:n_rows]
    c, twin = out.clone(), out.clone()
    w4a8.lora(x, a8, b8, c, rows)
    w4a8.lora(x, a8, b8, twin, rows, fallback=True)
    assert torch.equal(c, twin)
    others = torch.ones(24, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(c[others], out[others])


@needs_kernel
@pytest.mark.parametrize("widths", [(64, 32, 32), (48, 16), (40, 20, 36)], ids=["aligned", "two", "unaligned"])
@pytest.mark.parametrize("m", [1, 5, 17, 40])
@pytest.mark.parametrize("amx", [False, True])
def test_the_matmul_that_carries_the_lora_gives_the_layer_loops_bits(widths, m, amx):
    """The one-call block's matmul (`w4a8_linear_lora`: the deltas added tile by tile in the
    matmul's pass, or after it where a module's columns do not start on a tile) gives what the
    layer loop gets from the matmul and then the twin per module; a module without tables gets
    nothing. Rows in one run and scattered; the AMX path (from 32 rows) as well."""
    if amx and not w4a8.amx():
        pytest.skip("no AMX tiles here")
    lib = build.load("w4a8")
    k, n = 64, sum(widths)
    g = torch.Generator().manual_seed(m + n)
    w = w4a8.pack(torch.randn(n, k, generator=g) * 0.2)
    modules = [_tables(k, 8 + 8 * j, width, j + m) for j, width in enumerate(widths)]
    modules[1] = None
    x = (torch.randn(m, k, generator=g) * 2).to(torch.bfloat16)
    fn = lib.w4a8_linear_lora
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [P, I, I, P, I, P, ctypes.c_int, ctypes.c_int, P, P, P, P, I], ctypes.c_int
    ptrs = [p for ab in modules for p in ([0] * 4 if ab is None else [ab[0].packed.data_ptr(), ab[0].scale.data_ptr(),
                                                                      ab[1].packed.data_ptr(), ab[1].scale.data_ptr()])]
    ranks = (I * len(widths))(*[0 if ab is None else ab[0].shape[0] for ab in modules])
    cols = (I * len(widths))(*widths)
    try:
        w4a8.amx(amx)
        for rows in (torch.arange(m)[m // 2 :], torch.randperm(m, generator=g)[: max(1, m // 3)]):
            y = torch.empty(m, n, dtype=torch.bfloat16)
            assert fn(x.data_ptr(), m, k, w.packed.data_ptr(), n, y.data_ptr(), 2, len(widths),
                      (P * len(ptrs))(*ptrs), ranks, cols, rows.data_ptr(), rows.shape[0]) == 0
            loop = w(x, fallback=True)
            for ab, part in zip(modules, loop.split(widths, -1)):
                if ab is not None:
                    w4a8.lora(x, *ab, part, rows, fallback=True)
            assert torch.equal(y, loop), rows.tolist()
            assert not torch.equal(y, w(x, fallback=True))
    finally:
        w4a8.amx(True)


@needs_kernel
@pytest.mark.parametrize("march,isa,needs", BUILDS, ids=[b[0] for b in BUILDS])
def test_every_vector_path_of_the_lora_gives_the_twins_bits(kernel_build, march, isa, needs):
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}")
    fn = ctypes.CDLL(kernel_build("w4a8", march)).w8a8_lora
    P, I = ctypes.c_void_p, ctypes.c_int64
    fn.argtypes, fn.restype = [P, I, I, P, P, I, P, P, I, P, I, P, I, ctypes.c_int], ctypes.c_int
    for k, r, n, n_rows in [(576, 16, 192, 9), (100, 3, 70, 4), (64, 48, 40, 17)]:
        a8, b8 = _tables(k, r, n, k)
        x, out_ = _inputs(20, k, n, r)
        rows = torch.randperm(20, generator=torch.Generator().manual_seed(n))[:n_rows]
        c, twin = out_.clone(), out_.clone()
        assert fn(x.data_ptr(), k, k, a8.packed.data_ptr(), a8.scale.data_ptr(), r, b8.packed.data_ptr(),
                  b8.scale.data_ptr(), n, c.data_ptr(), n, rows.data_ptr(), n_rows, 2) == 0
        w4a8.lora(x, a8, b8, twin, rows, fallback=True)
        assert torch.equal(c, twin), (isa, k, r, n)


def test_tables_that_do_not_fit_the_input_are_refused():
    a8, b8 = _tables(64, 8, 32, 0)
    x, out = _inputs(4, 96, 32, 0)
    with pytest.raises(ValueError, match="do not fit"):
        w4a8.lora(x, a8, b8, out, torch.tensor([0]))
