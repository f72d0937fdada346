"""Weight formats: the quantizers round-trip within their step, a Q4_1-style grid is reproduced,
every weight kernel gives a row the same bits at any number of rows, and a model put in a format
runs it (and refuses what it cannot run)."""

import pytest
import torch

from selfspec.checkpoint.quant import INT4_GROUP, Int4Weight, Int8Weight, int4_fits, quantize
from selfspec.engine.forward.forward import matmul
from selfspec.kernels.w4a8 import W4A8Weight, W8A8Weight
from selfspec.engine.measure.formats import set_weights
from selfspec.engine.forward.forward import FastForward

from conftest import tiny_model
from matrix import FORMATS


def _w(n=64, k=96, seed=0):
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def test_int8_round_trips_within_half_a_step_per_row():
    w = _w()
    q = quantize(w, "int8")
    step = w.abs().amax(1, keepdim=True) / 127
    err = (q.dequantize() - w).abs()
    assert isinstance(q, Int8Weight) and bool((err <= step / 2 * 1.01 + 1e-7).all())


def test_int4_round_trips_within_half_a_step_per_group():
    w = _w()
    q = quantize(w, "int4")
    g = w.view(64, -1, INT4_GROUP)
    step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(INT4_GROUP, 1)
    err = (q.dequantize() - w).abs()
    # half a step, plus the bf16 rounding of the group's scale and zero and of the kernel's output
    assert isinstance(q, Int4Weight) and bool((err <= step / 2 + 0.02 * w.abs().amax()).all())
    assert float(err.mean()) < float(step.mean()) / 3


def test_a_weight_already_on_a_q4_1_grid_is_reproduced():
    """Blocks of 32 as d * q + m, q in 0..15 with both ends used (what a Q4_1 GGUF holds), with d
    and m exact in bf16: int4 gives back the same weights up to the bf16 rounding of the kernel's
    zero point (m + 8 d) and of its output, far inside one quantization step."""
    g = torch.Generator().manual_seed(1)
    d = (torch.rand(64, 3, 1, generator=g) * 0.01 + 0.001).bfloat16().float()
    m = (torch.rand(64, 3, 1, generator=g) * -0.05).bfloat16().float()
    q = torch.randint(0, 16, (64, 3, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    w = (d * q + m).view(64, 96)
    back = quantize(w, "int4").dequantize()
    zero = (m + 8 * d).expand(64, 3, 32).reshape(64, 96)
    assert bool(((back - w).abs() <= 2 ** -8 * (w.abs() + zero.abs()) + 1e-7).all())
    err = (back - w).abs().view(64, 3, 32)
    assert float((err / d).max()) < 0.5  # never a neighbouring level


@pytest.mark.parametrize("fmt,k", [("bf16", 64), ("int8", 64), ("int4", 64), ("int8", 1536), ("int4", 1536),
                                   ("w4a8", 576), ("w4a8", 1536)])
def test_every_weight_kernel_gives_a_row_the_same_bits_at_any_number_of_rows(fmt, k):
    """int8 / int4 at the default model's widest reduction too; bf16 only at small k: CPUs with
    native bf16 dot products reduce a long row in another order for one row than for many
    (`test_a_format_asked_for_by_name_warns_where_this_cpu_breaks_its_invariance`)."""
    w = quantize(_w(128, k), fmt)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    for start in (0, 5):
        alone = matmul(x[start:start + 1], w)
        for rows in range(2, 34):
            assert torch.equal(matmul(x[start:start + rows], w)[:1], alone), (fmt, rows)


def test_int4_takes_only_the_shapes_its_kernel_takes_and_falls_back_to_int8():
    assert int4_fits(_w(64, 96)) and not int4_fits(_w(261, 32)) and not int4_fits(_w(64, 40))
    assert isinstance(quantize(_w(261, 32), "int4"), Int8Weight)
    with pytest.raises(ValueError, match="unknown weight format"):
        quantize(_w(), "int3")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_model_in_a_format_runs_it(fmt):
    m = set_weights(tiny_model(), fmt)
    ff = FastForward.of(m)
    assert ff.weights == fmt and ff.exact == (fmt != "fp32")
    packed = {"int8": (Int8Weight,), "int4": (Int4Weight, Int8Weight), "w4a8": (W4A8Weight,)}.get(fmt, (torch.Tensor,))
    head = {"int8": Int8Weight, "int4": (Int4Weight, Int8Weight), "w4a8": W8A8Weight}.get(fmt, torch.Tensor)
    assert isinstance(ff.layers[0].wo, packed) and isinstance(ff.head, head)
    m.to(torch.float32)  # the packed weights are stale now: the model's own weights run
    assert FastForward.of(m).weights == "fp32"


def test_bad_formats_and_int_formats_off_the_cpu_are_refused_before_loading():
    from selfspec.loading import resolve_weights

    with pytest.raises(ValueError, match="unknown weights"):
        resolve_weights("int2", None, None, None)
    with pytest.raises(ValueError, match="disagree"):
        resolve_weights("int4", torch.float32, None, None)
    with pytest.raises(ValueError, match="CPU kernels"):
        resolve_weights("int8", None, "cuda", None)
    assert resolve_weights(None, "bfloat16", None, None) is None and resolve_weights("bf16", "bfloat16", None, None)


def test_a_format_asked_for_by_name_warns_where_this_cpu_breaks_its_invariance(monkeypatch):
    """"auto" only picks a format whose forward passed the width-invariance probe; a format named
    by the user is probed too, and a failure is said once, at load, not found later in the tokens."""
    import warnings

    import selfspec
    from selfspec.engine.measure import formats

    monkeypatch.setattr(formats, "invariant", lambda model: False)
    with pytest.warns(UserWarning, match="not bitwise the same"):
        selfspec.load("pystdlib-nld-9m", weights="bf16", progress=False)
    monkeypatch.setattr(formats, "invariant", lambda model: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selfspec.load("pystdlib-nld-9m", weights="int4", progress=False)


def test_auto_picks_the_fastest_format_that_is_invariant_and_close_to_fp32():
    from selfspec.engine.measure.formats import _pick

    report = {"fp32": {"seconds": 0.05, "invariant": False, "agreement": 1.0, "kl": 0.0},
              "bf16": {"seconds": 0.001, "invariant": False, "agreement": 0.99, "kl": 0.0},  # fastest, not exact
              "int4": {"seconds": 0.012, "invariant": True, "agreement": 0.96, "kl": 0.002},
              "w4a8": {"seconds": 0.010, "invariant": True, "agreement": 0.97, "kl": 0.004},
              "int8": {"seconds": 0.002, "invariant": True, "agreement": 0.80, "kl": 0.3}}  # too far from fp32
    assert _pick(report) == "w4a8"
    report["w4a8"]["seconds"] = 0.02
    assert _pick(report) == "int4"


def test_measuring_the_formats_times_rounds_and_checks_each_one(monkeypatch):
    """`measure` on a tiny model: every candidate gets a round time, its invariance and its
    agreement with fp32; the round time reads a width-8 forward as well as a width-1 one."""
    from selfspec.engine.measure import formats

    widths = []
    real = formats._round_seconds

    def spy(model, cached=128):
        from selfspec.engine.forward.batch_forward import BatchForward

        orig = BatchForward.__call__
        monkeypatch.setattr(BatchForward, "__call__", lambda self, toks, *a, **k: (widths.append(toks.shape[1]),
                                                                                     orig(self, toks, *a, **k))[1])
        try:
            return real(model, cached=16)
        finally:
            monkeypatch.setattr(BatchForward, "__call__", orig)

    monkeypatch.setattr(formats, "_round_seconds", spy)
    report = formats.measure(tiny_model(), torch.arange(5, 40) % 60 + 4, candidates=("fp32", "int4", "w4a8"),
                             progress=False)
    assert set(report) == {"fp32", "int4", "w4a8"} and {1, 8} <= set(widths)
    assert report["w4a8"]["invariant"] and report["int4"]["invariant"] and report["w4a8"]["seconds"] > 0
