"""Weight formats: int8 and int4 weight-only quantization for torch's own CPU kernels.

    q = quantize(w, "int4")      # w: a Linear's weight [out, in], fp32
    y = q(x_bf16)                # torch._weight_int4pack_mm_for_cpu: bf16 in, bf16 out
    q.dequantize()               # the weight the kernel multiplies with, fp32

* int8: symmetric per output channel, scale = max |w_row| / 127, w ~= q * scale
  (`torch._weight_int8pack_mm`).
* int4: asymmetric per group of `group` inputs along each row: scale = (max - min) / 15 and
  q = round((w - min) / scale) in 0..15, so w ~= (q - 8) * scale + zero with zero = min + 8 * scale
  (`torch._weight_int4pack_mm_for_cpu`, which takes the scales and zeros in bf16). A weight that is
  already on such a grid (the default model comes from a Q4_1 GGUF: blocks of 32 with a scale and
  a minimum) is reproduced up to the bf16 rounding of its scales and zeros.

* w4a8: 4-bit weights on GGUF's Q4_1 grid (groups of 32, fp16 scale and minimum) times
  activations quantized to int8 per block of 32, integer dot products (`selfspec.kernels.w4a8`:
  a C kernel built on first use, or the same bits in torch ops without a compiler). One pass over
  the weights for all rows: 16 rows cost far less than 4 passes of int4.

The int8 and int4 kernels run their fast paths with bf16 activations only, and a row's output does not depend
on how many other rows share the call (bitwise; `tests/test_quant.py`). Weights are quantized at
load from the checkpoint's own weights: nothing new is stored, any NLD checkpoint works, and no
file depends on the packed layout of one torch version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.kernels import w4a8

FORMATS = ("fp32", "bf16", "int8", "int4", "w4a8")
INT_FORMATS = ("int8", "int4", "w4a8")  # packed at load for CPU kernels; bf16 activations
INT4_GROUP = 32


@dataclass(frozen=True)
class Int8Weight:
    """int8 [out, in] and one bf16 scale per output row."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), self.q, self.scales)
        return y.reshape(*lead, y.shape[-1])

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scales.float()[:, None]


@dataclass(frozen=True)
class Int4Weight:
    """int4 packed for the CPU kernel, bf16 (scale, zero) per group of `group` inputs per row."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor  # [in / group, out, 2]
    group: int
    shape: tuple[int, int]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]), self.packed, self.group, self.scales_zeros)
        return y.reshape(*lead, y.shape[-1])

    def dequantize(self) -> torch.Tensor:
        eye = torch.eye(self.shape[1], dtype=torch.bfloat16)
        return self(eye).float().T.contiguous()


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    w = w.detach().float()
    scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(torch.bfloat16)  # rounded first: q uses the kernel's scale
    q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> Int4Weight:
    w = w.detach().float()
    n, k = w.shape
    g = w.view(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-12).to(torch.bfloat16).float()  # rounded first, as the kernel reads them
    zero = (lo + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((g - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.int32).view(n, k)
    sz = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return Int4Weight(torch._convert_weight_to_int4pack_for_cpu(q, 1), sz, group, (n, k))


def int4_fits(w: torch.Tensor, group: int = INT4_GROUP) -> bool:
    """The int4 kernel's shape rule: whole groups along the input, rows in blocks of 16."""
    return w.dim() == 2 and w.shape[1] % group == 0 and w.shape[0] % 16 == 0


def quantize(w: torch.Tensor, fmt: str, *, head: bool = False):
    """A Linear weight [out, in] in format `fmt`: a tensor (fp32, bf16) or a quantized weight.
    A shape the int4 kernel cannot take falls back to int8 (a tiny model's odd projection); w4a8
    keeps an output head (`head`) at 8 bits."""
    if fmt == "fp32":
        return w.detach().float()
    if fmt == "bf16":
        return w.detach().to(torch.bfloat16)
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "int4":
        return quantize_int4(w) if int4_fits(w) else quantize_int8(w)
    if fmt == "w4a8":
        if not w4a8.fits(w):
            return quantize_int8(w)
        return w4a8.pack8(w) if head else w4a8.pack(w)
    raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")


# -- a model's quantized weights, valid while its own weights are unchanged -----------------------
@dataclass(frozen=True)
class Quantized:
    """A model's weights in an int format: per parameter name the packed weight; `key` is the
    model's `weights_key` when they were made (a later `model.to` or edit makes them stale)."""

    name: str
    weights: dict
    key: tuple


def attach(model, fmt: str, packed: dict) -> None:
    """Keep `packed` (parameter name -> quantized weight) as `model`'s weights in format `fmt`."""
    model.__dict__["selfspec_weights"] = Quantized(fmt, packed, weights_key(model))


def quantized_of(model) -> Quantized | None:
    """The model's quantized weights, if they were made from its current weights (a `model.to`
    or an edit since makes them stale: the model's own weights are used then)."""
    fmt = model.__dict__.get("selfspec_weights")
    return fmt if fmt is not None and fmt.key == weights_key(model) else None


def weights_key(model) -> tuple:
    """Identity of the weights a forward copies or fuses: storage, dtype, device and in-place
    version of every parameter. `model.to(...)`, `.half()`, loading new weights or editing one in
    place all change it."""
    return tuple((p.data_ptr(), p.dtype, p.device, 0 if p.is_inference() else p._version) for p in parameters(model))


def parameters(model) -> list:
    """`list(model.parameters())` (the same tensors in the same order, a shared one once) by a plain
    walk over the modules' own dicts: read several times per generation (`weights_key`,
    `FastForward.supports`), where `Module.parameters()`' generic walk was most of a key's time."""
    out, seen, done = [], set(), set()

    def walk(m):
        if id(m) in done:
            return
        done.add(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        for c in m._modules.values():
            if c is not None:
                walk(c)

    walk(model)
    return out
