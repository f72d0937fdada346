"""The w4a8 kernels (4-bit weights, and the 8-bit head, times int8 activations): the C kernel and
its torch fallback give the same bits, a row's output is the same at any number of rows, the
output is the dequantized weights times the quantized activations, and a weight already on
GGUF's Q4_1 grid is kept exactly."""

import ctypes

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
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_activations_half_way_between_two_steps_round_to_even_as_the_twin_does(dtype):
    """Blocks whose largest magnitude is 127 (the step is 1) holding k + 0.5, -0.5 and -0: each
    rounds to the even neighbour, in the vector loop and the twin; a weight of ones sums them."""
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -0.0, 126.5, -126.5, 127.0, 4.0] * 3)[:32]
    x = torch.stack([halves, -halves, halves * 0.5 + 0.25, torch.zeros(32)]).to(dtype).repeat(1, 4)
    w = w4a8.pack8(torch.ones(16, 128))
    assert torch.equal(w(x, dtype=torch.float32), w(x, fallback=True, dtype=torch.float32))
    xq, _, _ = w4a8.quantize_rows(x[:1])
    assert xq[0, 0, :6].tolist() == [0, 2, 2, 0, -2, -2]


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
    monkeypatch.setattr(w4a8, "_entry", {})  # the entry points a process looked up once
    assert w4a8.kernel() is None and w4a8.isa() == "torch"
    w = _packs(32, 64)[0]
    x = _x(3, 64)
    assert torch.equal(w(x), w(x, fallback=True))


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), ":").split(":", 1)[1].split())
    except OSError:
        return set()


# each vector path of w4a8.c, built for a CPU that has it: (-march, the isa it reports, the CPU flags it needs)
BUILDS = [("x86-64", "scalar", set()), ("haswell", "avx2", {"avx2", "f16c", "fma"}),
          ("skylake-avx512", "avx2", {"avx2", "f16c", "fma", "avx512f", "avx512bw"}),  # AVX-512 without VNNI
          ("icelake-server", "avx512-vnni", {"avx512f", "avx512bw", "avx512_vnni"})]


@needs_kernel
@pytest.mark.parametrize("march,isa,needs", BUILDS, ids=[b[0] for b in BUILDS])
def test_every_vector_path_gives_the_torch_fallbacks_bits(kernel_build, march, isa, needs):
    """The scalar, AVX2 and AVX-512 VNNI paths (what other CPUs run) against the torch fallback,
    at row counts below, at and past each path's rows per pass."""
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - _cpu_flags())}")
    lib = ctypes.CDLL(kernel_build("w4a8", march))
    lib.w4a8_isa.restype = ctypes.c_char_p
    assert lib.w4a8_isa() == isa.encode()
    for w in _packs(64, 576):
        name = "w8a8_linear" if isinstance(w, w4a8.W8A8Weight) else "w4a8_linear"
        fn = getattr(lib, name)
        fn.argtypes = w4a8._ARGS8 if name == "w8a8_linear" else w4a8._ARGS
        for m in (1, 3, 4, 5, 8, 11):
            x = _x(m + 1, 576)[1:]  # row 1 of _x: a block of zeros
            y = torch.empty(m, 64)
            extra = [w.scale.data_ptr()] if name == "w8a8_linear" else []
            assert fn(x.data_ptr(), 1, m, 576, w.packed.data_ptr(), *extra, 64, y.data_ptr(), 0, 2) == 0
            assert torch.equal(y, w(x, dtype=torch.float32, fallback=True)), (name, m)


needs_amx = pytest.mark.skipif(not w4a8.amx(), reason="no AMX tiles on this CPU (or the OS refuses them)")


@pytest.fixture
def amx_restored():
    yield
    w4a8.amx(True)


@needs_kernel
@needs_amx
@pytest.mark.parametrize("n,k", SHAPES)
def test_amx_tiles_give_the_vector_loops_bits_at_every_row_count(n, k, amx_restored):
    """Past AMX_MIN4 (w4a8) or AMX_MIN8 (w8a8) rows the kernel multiplies 16 rows at a time with
    tiles and leaves a last group of fewer than 4 to the vector loops: every row count around those
    edges gives the vector loops' bits, and the torch fallback's."""
    x = _x(100, k)
    for w in _packs(n, k):
        for m in (7, 8, 9, 16, 17, 19, 20, 31, 32, 33, 35, 36, 48, 63, 64, 65, 100):
            w4a8.amx(True)
            tiles = w(x[:m], dtype=torch.float32)
            w4a8.amx(False)
            vector = w(x[:m], dtype=torch.float32)
            assert torch.equal(tiles, vector), (type(w).__name__, m)
            assert torch.equal(tiles, w(x[:m], dtype=torch.float32, fallback=True)), (type(w).__name__, m)
