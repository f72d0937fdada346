"""The w4a8 kernels (4-bit weights, and the 8-bit head, times int8 activations): the C kernel and
its torch fallback give the same bits, a row's output is the same at any number of rows, the
output is the dequantized weights times the quantized activations, and a weight already on
GGUF's Q4_1 grid is kept exactly."""

import ctypes
import os

import pytest
import torch

from selfspec.kernels import build, w4a8

SHAPES = [(96, 576), (64, 1536), (49, 64)]  # the default model's two reductions; outputs padded to tiles


def _x(m, k, seed=1, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[:, 5] = 40.0  # an outlier column: its blocks get a coarse step, the others keep theirs
    x[1, :32] = 0.0  # a block of zeros: scale 0, no division by it
    return x.to(dtype)


def _packs(n, k):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)) * 0.05
    return [w4a8.pack(w), w4a8.pack8(w)]


needs_kernel = pytest.mark.skipif(w4a8.kernel() is None, reason=f"no C kernel here: {build.error('w4a8')}")


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_c_kernel_and_the_torch_fallback_give_the_same_bits(n, k, dtype):
    x = _x(21, k, dtype=dtype)
    for w in _packs(n, k):
        assert torch.equal(w(x), w(x, fallback=True)), type(w).__name__
        assert torch.equal(w(x, dtype=torch.float32), w(x, fallback=True, dtype=torch.float32)), type(w).__name__


@needs_kernel
@pytest.mark.parametrize("n,k", SHAPES[:2])
def test_a_row_gets_the_same_bits_alone_and_among_up_to_64_rows(n, k):
    x = _x(64, k)
    for w in _packs(n, k):
        full = w(x, dtype=torch.float32)
        for rows in list(range(1, 18)) + [31, 33, 64]:
            assert torch.equal(w(x[:rows], dtype=torch.float32), full[:rows]), (type(w).__name__, rows)
        assert torch.equal(w(x[40:41], dtype=torch.float32), full[40:41])


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_output_is_the_dequantized_weight_times_the_quantized_activations(n, k):
    x = _x(9, k)
    xq, d, _ = w4a8.quantize_rows(x.float())
    xd = (xq * d[..., None]).view(9, k)
    assert float((xd - x.float()).abs().max()) <= float(d.max()) / 2 * 1.0001  # half a step per block
    for w in _packs(n, k):
        ref = xd @ w.dequantize().T
        got = w(x, fallback=True).float()
        assert bool(((got - ref).abs() <= 2 ** -8 * ref.abs() + 1e-3 * ref.abs().max()).all())  # bf16 output


def test_a_weight_on_the_q4_1_grid_is_kept_exactly():
    g = torch.Generator().manual_seed(3)
    n, k = 32, 64
    s = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=g) * 0.05).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each block spans its range, so the grid found is the one made
    w = (q * s[..., None] + m[..., None]).view(n, k)
    assert torch.equal(w4a8.pack(w).dequantize(), w)


def test_pack_and_unpack_are_inverse_and_shapes_are_checked():
    w = torch.randn(40, 64)
    q, s, m = w4a8.grid(w)
    assert torch.equal(torch.stack(w4a8.unpack(w4a8.pack(w).packed, (40, 64))[1:]), torch.stack([s, m]))
    assert torch.equal(w4a8.unpack(w4a8.pack(w).packed, (40, 64))[0], q)
    with pytest.raises(ValueError, match="K % 32"):
        w4a8.pack(torch.randn(16, 40))


def test_without_a_compiler_the_fallback_runs_and_says_so(monkeypatch):
    monkeypatch.setitem(build._loaded, "w4a8", None)
    assert w4a8.kernel() is None and w4a8.isa() == "torch"
    w = _packs(32, 64)[0]
    x = _x(3, 64)
    assert torch.equal(w(x), w(x, fallback=True))


@needs_kernel
def test_a_build_without_avx512_gives_the_same_bits(tmp_path):
    """The portable C path (what a CPU without AVX-512 VNNI runs) against this machine's build."""
    out = str(tmp_path / "w4a8_portable.so")
    flags = [f for f in build.FLAGS if f != "-march=native"] + ["-march=x86-64"]
    err = build.compile_c(build.compiler(), os.path.join(build.HERE, "w4a8.c"), out, flags)
    assert err is None, err
    lib = ctypes.CDLL(out)
    lib.w4a8_isa.restype = ctypes.c_char_p
    assert lib.w4a8_isa() == b"scalar"
    for w in _packs(64, 576):
        name = "w8a8_linear" if isinstance(w, w4a8.W8A8Weight) else "w4a8_linear"
        fn = getattr(lib, name)
        fn.argtypes = w4a8._ARGS8 if name == "w8a8_linear" else w4a8._ARGS
        x = _x(11, 576)
        y = torch.empty(11, 64)
        extra = [w.scale.data_ptr()] if name == "w8a8_linear" else []
        assert fn(x.data_ptr(), 1, 11, 576, w.packed.data_ptr(), *extra, 64, y.data_ptr(), 0, 2) == 0
        assert torch.equal(y, w(x, dtype=torch.float32)), name
