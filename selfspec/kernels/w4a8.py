"""w4a8: 4-bit weights times activations quantized to int8, flat in the number of rows.

    w = pack(weight)            # weight [N, K] fp32 -> W4A8Weight (groups of 32: fp16 scale, minimum)
    y = w(x)                    # x [..., K] bf16 or fp32 -> [..., N] bf16
    w.dequantize()              # the weight the kernel multiplies with, fp32 [N, K]

torch's int4 kernel dequantizes every weight block once per 4 query rows, so a round of 16
tokens reads and converts its weights four times. Here each weight tile is read once for all
rows and multiplied as integers (AVX-512 VNNI: 64 products a instruction): 16 rows cost little
more than one. The numerics (`w4a8.c`'s header) are exact integer dot products per block of 32
and one fixed order of float steps per output element, so a row's output is bitwise the same at
any number of rows; `reference` computes the same bits with torch ops and is what runs when the
C kernel cannot be built (no compiler), much slower.

Weights on GGUF's Q4_1 grid (the default model: blocks of 32, fp16 scale and minimum) are kept
exactly; others are put on it here (scale = (max - min) / 15 and minimum, both rounded to fp16).
Activations: per row and block of 32, d = max |x| / 127 and xq = rint(x * 127 / max |x|), as
llama.cpp quantizes activations for its Q4_1 dot products.

An output head loses too much at 4 bits (the default model's top-1 agreement with fp32 falls from
0.97 to 0.91 on the format probe): `pack8` keeps it at 8 bits (int8 per output, fp32 scale) with
the same activations (`W8A8Weight`: 0.97 agreement, as torch's int8 head).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from selfspec.kernels import build

TILE, BLOCK, TILE_BYTES, TILE_BYTES8 = 16, 32, 320, 512


def fits(w: torch.Tensor) -> bool:
    """The layout's shape rule: whole blocks of 32 inputs (outputs are padded to tiles of 16:
    the default model's head has 49,153)."""
    return w.dim() == 2 and w.shape[1] % BLOCK == 0


def grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] uint8 in 0..15, scale [N, K/32] fp16, minimum [N, K/32] fp16) with w ~= q * s + m."""
    w = w.detach().float()
    n, k = w.shape
    g = w.view(n, k // BLOCK, BLOCK)
    lo, hi = g.amin(-1), g.amax(-1)
    m = lo.to(torch.float16)
    s = ((hi - m.float()) / 15).to(torch.float16)
    s = torch.where(s.float() > 0, s, torch.ones_like(s) * 2.0 ** -24)  # a constant block: any positive scale
    q = torch.round((g - m.float()[..., None]) / s.float()[..., None]).clamp(0, 15).to(torch.uint8)
    return q.view(n, k), s, m


def pack(w: torch.Tensor) -> "W4A8Weight":
    if not fits(w):
        raise ValueError(f"w4a8 needs [N, K] with K % {BLOCK} == 0, got {tuple(w.shape)}")
    n, k = w.shape
    pad = -n % TILE
    q, s, m = grid(torch.cat([w.detach().float(), w.new_zeros(pad, k).float()]) if pad else w)
    nb, tiles = k // BLOCK, (n + pad) // TILE
    # nibbles: [tile, block, chunk c, output j, i] = q[16 tile + j, 32 block + 8 c + i] | q[..., + 4] << 4
    qt = q.view(tiles, TILE, nb, 4, 2, 4).permute(0, 2, 3, 1, 4, 5)  # tile, block, c, j, half, i
    nib = (qt[..., 0, :] | (qt[..., 1, :] << 4)).reshape(tiles, nb, 256)
    sm = torch.stack([s, m]).view(2, tiles, TILE, nb).permute(1, 3, 0, 2).reshape(tiles, nb, 2 * TILE)
    packed = torch.cat([nib, sm.contiguous().view(torch.uint8)], -1).contiguous()
    return W4A8Weight(packed, (n, k))


def unpack(packed: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack's inverse: (q [N, K] uint8, scale fp16 [N, K/32], minimum fp16 [N, K/32])."""
    n, k = shape
    tiles, nb = packed.shape[0], k // BLOCK
    pad_n = tiles * TILE
    nib = packed[..., :256].reshape(tiles, nb, 4, TILE, 4)
    q = torch.stack([nib & 15, nib >> 4], -2)  # tile, block, c, j, half, i
    q = q.permute(0, 3, 1, 2, 4, 5).reshape(pad_n, k)[:n]
    sm = packed[..., 256:].contiguous().view(torch.float16).view(tiles, nb, 2, TILE).permute(2, 0, 3, 1)
    sm = sm.reshape(2, pad_n, nb)[:, :n]
    return q, sm[0], sm[1]


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K/32, 32] fp32 integers, d [M, K/32], c [M, K/32]) as the kernel makes them."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    xq = torch.round(xb * inv[..., None])
    d = amax / torch.full_like(amax, 127.0)
    return xq, d, d * xq.sum(-1)


def reference(x: torch.Tensor, packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The kernel's output, bit for bit, in torch ops: x [M, K] -> [M, N] fp32."""
    q, s, m = unpack(packed, shape)
    xq, d, c = quantize_rows(x)
    n, k = shape
    qb = q.float().view(n, k // BLOCK, BLOCK).permute(1, 2, 0)  # block, i, out
    isum = torch.bmm(xq.transpose(0, 1), qb)  # [block, M, N]: integers below 2^16, exact in fp32
    s, m = s.float().T, m.float().T  # [block, N]
    acc = torch.zeros(x.shape[0], n)
    for b in range(k // BLOCK):  # the kernel's order
        acc = acc + ((isum[b] * s[b]) * d[:, b, None] + m[b] * c[:, b, None])
    return acc


def pack8(w: torch.Tensor) -> "W8A8Weight":
    """w [N, K] -> int8 per output (symmetric, fp32 scale max |w| / 127) in the w8a8 layout."""
    if not fits(w):
        raise ValueError(f"w8a8 needs [N, K] with K % {BLOCK} == 0, got {tuple(w.shape)}")
    w = w.detach().float()
    n, k = w.shape
    scale = (w.abs().amax(1) / 127).clamp(min=1e-30)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int16)
    pad = -n % TILE
    qp = torch.cat([q, q.new_zeros(pad, k)]) if pad else q
    tiles, nb = (n + pad) // TILE, k // BLOCK
    # [tile, block, chunk c, output j, i] = q[16 tile + j, 32 block + 4 c + i] + 128
    u = (qp + 128).to(torch.uint8).view(tiles, TILE, nb, 8, 4).permute(0, 2, 3, 1, 4)
    return W8A8Weight(u.reshape(tiles, nb, TILE_BYTES8).contiguous(), scale.contiguous(), (n, k))


def reference8(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """W8A8Weight's output, bit for bit, in torch ops: x [M, K] -> [M, N] fp32."""
    n, k = shape
    q = _unpack8(packed, shape).float().view(n, k // BLOCK, BLOCK).permute(1, 2, 0)  # block, i, out
    xq, d, _ = quantize_rows(x)
    isum = torch.bmm(xq.transpose(0, 1), q)  # [block, M, N]: integers below 2^19, exact in fp32
    acc = torch.zeros(x.shape[0], n)
    for b in range(k // BLOCK):
        acc = acc + isum[b] * d[:, b, None]
    return acc * scale


def _unpack8(packed: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    n, k = shape
    tiles, nb = packed.shape[0], k // BLOCK
    u = packed.view(tiles, nb, 8, TILE, 4).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, k)[:n]
    return u.to(torch.int16) - 128


_ARGS = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
_ARGS8 = _ARGS[:5] + [ctypes.c_void_p] + _ARGS[5:]


def kernel(name: str = "w4a8_linear"):
    """A C entry point ("w4a8_linear" or "w8a8_linear"), or None (the fallback runs;
    `build.error("w4a8")` says why)."""
    lib = build.load("w4a8")
    if lib is None:
        return None
    fn = getattr(lib, name)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = (_ARGS8 if name == "w8a8_linear" else _ARGS), ctypes.c_int
        lib.w4a8_isa.restype = ctypes.c_char_p
    return fn


def isa() -> str:
    """What the kernel runs on this machine: "avx512-vnni", "avx2", "scalar", or "torch" (fallback)."""
    lib = build.load("w4a8")
    if lib is None:
        return "torch"
    kernel()
    return lib.w4a8_isa().decode()


def amx(want: bool | None = None) -> bool:
    """Whether the kernel multiplies many rows (AMX_MIN4 for w4a8, AMX_MIN8 for w8a8) with AMX tiles
    (`w4a8_amx.h`, the same bits as its vector loops): `want` False keeps to the vector loops, True uses tiles where the CPU
    has them and the OS permits them, None asks. False where the build has no tile path."""
    lib = build.load("w4a8")
    if lib is None or not hasattr(lib, "w4a8_amx"):
        return False
    return bool(lib.w4a8_amx(-1 if want is None else int(want)))


_entry: dict = {}  # name -> the C entry point or None, once looked up (asked ~120 times a forward)


def _linear(x: torch.Tensor, name: str, weights: tuple, ref, shape: tuple[int, int], fallback: bool, dtype):
    """x [..., K] through the C entry point `name` (its weight tensors `weights`), or through `ref`
    (the same bits in torch) when it cannot run or `fallback`; [..., N] in `dtype`."""
    if dtype is not torch.bfloat16 and dtype is not torch.float32:
        raise ValueError(f"{name[:4]} gives bf16 or fp32, not {dtype}")
    fn = None if fallback else _entry.get(name, False)
    if fn is False:
        fn = _entry[name] = kernel(name)
    lead = None
    # the runtime's call (rows of bf16 / fp32 activations) goes straight through: no reshape, no copy
    if not (x.dim() == 2 and (x.dtype is torch.bfloat16 or x.dtype is torch.float32) and x.is_cpu
            and x.is_contiguous()):
        lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
        if fn is not None:
            x = (x if x.dtype in (torch.bfloat16, torch.float32) else x.float()).contiguous()
    if fn is None:
        y = ref(x).to(dtype)
    else:
        y = torch.empty((x.shape[0], shape[0]), dtype=dtype)
        if fn(x.data_ptr(), x.dtype is torch.bfloat16, x.shape[0], x.shape[1], *(w.data_ptr() for w in weights),
              shape[0], y.data_ptr(), dtype is torch.bfloat16, torch.get_num_threads()):
            raise MemoryError(f"{name[:4]}: out of memory for the quantized activations")
    return y if lead is None else y.reshape(*lead, shape[0])


@dataclass(frozen=True)
class W4A8Weight:
    """A weight [N, K] packed for the w4a8 kernel (`pack`)."""

    packed: torch.Tensor  # [N / 16, K / 32, 320] uint8
    shape: tuple[int, int]

    def __call__(self, x: torch.Tensor, *, fallback: bool = False, dtype=torch.bfloat16) -> torch.Tensor:
        """x [..., K] -> [..., N] in `dtype` (bf16, or fp32: the kernel's sums before rounding)."""
        return _linear(x, "w4a8_linear", (self.packed,), lambda x2: reference(x2, self.packed, self.shape),
                       self.shape, fallback, dtype)

    def dequantize(self) -> torch.Tensor:
        q, s, m = unpack(self.packed, self.shape)
        n, k = self.shape
        w = q.float().view(n, k // BLOCK, BLOCK) * s.float()[..., None] + m.float()[..., None]
        return w.view(n, k)


@dataclass(frozen=True)
class W8A8Weight:
    """A weight [N, K] as int8 per output times int8 activations (`pack8`)."""

    packed: torch.Tensor  # [ceil(N / 16), K / 32, 512] uint8
    scale: torch.Tensor  # [N] fp32
    shape: tuple[int, int]

    def __call__(self, x: torch.Tensor, *, fallback: bool = False, dtype=torch.bfloat16) -> torch.Tensor:
        return _linear(x, "w8a8_linear", (self.packed, self.scale),
                       lambda x2: reference8(x2, self.packed, self.scale, self.shape), self.shape, fallback, dtype)

    def dequantize(self) -> torch.Tensor:
        return _unpack8(self.packed, self.shape).float() * self.scale[:, None]


def pack_lora(a: torch.Tensor, b: torch.Tensor) -> tuple[W8A8Weight, W8A8Weight]:
    """A draft LoRA module's A [r, K] and scaled B [N, r] -> its int8 tables for `lora`: each
    `pack8`ed with its inputs zero-padded to a multiple of 32 (`lora8.h`)."""
    pad = lambda w: torch.nn.functional.pad(w.detach().float(), (0, -w.shape[1] % BLOCK))  # noqa: E731
    return pack8(pad(a)), pack8(pad(b))


def lora(x: torch.Tensor, a8: W8A8Weight, b8: W8A8Weight, out: torch.Tensor, rows: torch.Tensor, *,
         fallback: bool = False) -> None:
    """out[rows] = bf16(out[rows] + b8(a8(x[rows]))), in place, each step a w8a8 product in fp32
    (`lora8.h`): x bf16 [M, K], out bf16 [M, N] (a column slice of a wider output is fine), rows
    int64 [n], the tables from `pack_lora`. The fallback computes the same bits in torch.

    Example: x = [[1, 2]], A = [[1, 1]], B = [[0.5], [-1]] (r = 1), out = [[1, 1]], rows = [0] ->
    u = 3, out = [[2.5, -2]] (every value here is exact on the int8 grids)."""
    r, kp = a8.shape
    n_out, rp = b8.shape
    fn = None if fallback else _entry.get("w8a8_lora", False)
    if fn is False:
        lib = build.load("w4a8")
        fn = _entry["w8a8_lora"] = None if lib is None else lib.w8a8_lora
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
            fn.restype = ctypes.c_int
    if x.shape[-1] > kp or out.shape[-1] != n_out or -x.shape[-1] % BLOCK != kp - x.shape[-1]:
        raise ValueError(f"lora: x [..., {x.shape[-1]}] / out [..., {out.shape[-1]}] do not fit tables "
                         f"[{r}, {kp}] / [{n_out}, {rp}]")
    if (fn is None or x.dim() != 2 or out.dim() != 2 or x.dtype is not torch.bfloat16
            or out.dtype is not torch.bfloat16 or x.stride(-1) != 1 or out.stride(-1) != 1
            or rows.dtype is not torch.int64 or not rows.is_contiguous()):
        xr = torch.nn.functional.pad(x[rows].float(), (0, kp - x.shape[-1]))
        u = torch.nn.functional.pad(reference8(xr, a8.packed, a8.scale, a8.shape), (0, rp - r))
        out[rows] = (out[rows].float() + reference8(u, b8.packed, b8.scale, b8.shape)).to(out.dtype)
        return
    if fn(x.data_ptr(), x.stride(0), x.shape[1], a8.packed.data_ptr(), a8.scale.data_ptr(), r,
          b8.packed.data_ptr(), b8.scale.data_ptr(), n_out, out.data_ptr(), out.stride(0), rows.data_ptr(),
          rows.shape[0], torch.get_num_threads()):
        raise MemoryError("w8a8_lora: out of memory")
