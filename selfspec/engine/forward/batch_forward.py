"""The compact forward over a batch of rows with ragged lengths (`cache.BatchKVCache`).

Same math and the same weights as `forward.FastForward` (it wraps one: fused q/k/v and gate/up,
RoPE tables, the output head), over tokens [R, q] of R cache rows at once. Row r's new tokens
sit at positions lengths[r] + offsets[r] and write their K/V at slots lengths[r] .. lengths[r]+q-1
(slot = position, no left padding). Attention of row r: every slot < lengths[r] (its prefix),
plus what `block[r]` [q, q] allows among its own new tokens; every other slot (a shorter row's
stale scratch up to the batch's widest row) is hidden by the float additive [R, 1, q, S] mask.

One row (a batch-1 generation) needs no prefix mask: its [q, S] mask is a reused buffer whose
prefix columns stay zero (`masks.MaskBuffer`), so a round costs O(q^2) mask work however long the
context is, and new tokens that all see each other (AR, a draft pass) get no mask at all.

Rows of a round are padded to one width q by the caller; a padding query must see at least one
key (SDPA yields NaN on a fully masked row): `masks.row_sets` lets it see itself, and no real token
sees it. Hidden masked slots still enter SDPA with weight 0, so they must be finite: the cache
only ever holds zeros or K/V the model wrote.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from selfspec.engine.forward.attention import exact_attention, write_attend
from selfspec.engine.forward.cache import BatchKVCache
from selfspec.engine.forward.forward import FastForward
from selfspec.engine.forward.masks import batch_mask, mask_buffer, own_block

class Join(NamedTuple):
    """A joining prompt's chunk run in a round's forward: `tokens` [k, c] of cache rows `rows`,
    causal among themselves, at positions lengths[rows] + 0..c-1 (rows shorter than c are padded
    at their end, as a separate prefill pads them)."""

    tokens: torch.Tensor
    rows: slice


KV_CACHE_DTYPES = {"int16": torch.int16, "int8": torch.int8}  # the exact formats' compact caches
# weight formats whose quality with the one-byte cache stays within issue 37's bound of their int16
# cache's (top-1 agreement with fp32 and KL within 0.005; `python -m selfspec bench quality
# --kv-cache`, measured on docs/results.md):
# kv_cache_dtype="auto" keeps int8 there
ONE_BYTE_FORMATS = ("w4a8", "int8")


def kv_cache_for(fmt: str | None) -> str:
    """The KV cache kv_cache_dtype="auto" (the default) keeps for weight format `fmt`: the one-byte
    cache where it costs no more quality than issue 37 allows (`ONE_BYTE_FORMATS`), else int16 (also
    the value that leaves a float format's float cache as it is)."""
    return "int8" if fmt in ONE_BYTE_FORMATS else "int16"


def set_kv_cache_dtype(model, kv_cache_dtype: str):
    """The compact cache the exact formats keep K and V in from now on: "int16" (the default: 15
    significant bits a value, exact for nearly every value) or "int8" (int8 values, K's times an
    integer scale per token and head, V's times a power of two: half the bytes, so
    half the memory per cached token and less time reading it at long contexts; its cost in
    quality is in docs/results.md). Float formats (fp32, bf16 on a GPU) keep their float cache:
    "int8" there raises. Returns the model."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; expected one of {tuple(KV_CACHE_DTYPES)}")
    if kv_cache_dtype != "int16" and not FastForward.of(model).exact:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is a compact cache of the exact weight formats "
                         f"(int8, int4, w4a8, bf16 on a CPU); this model's forward keeps a float cache")
    model.__dict__["selfspec_kv_cache"] = kv_cache_dtype
    return model


class BatchForward:
    """Batched forward passes over a `FastForward`'s weights into a `BatchKVCache`."""

    def __init__(self, ff: FastForward, kv_cache_dtype: str = "int16"):
        self.ff = ff
        self.kv_cache_dtype = kv_cache_dtype

    @classmethod
    def of(cls, model) -> "BatchForward":
        return cls(FastForward.of(model), model.__dict__.get("selfspec_kv_cache", "int16"))

    @property
    def cache_dtype(self) -> torch.dtype:
        """Exact attention keeps K and V compact: int16 (or int8, `set_kv_cache_dtype`) on its grids
        with a shift per token and head (`kernels.attn16.compress`)."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] if self.ff.exact else self.ff.dtype

    def new_cache(self, rows: int, capacity: int) -> BatchKVCache:
        ff = self.ff
        return BatchKVCache(ff.devices, ff.n_kv, ff.head_dim, rows, capacity, self.cache_dtype)

    def cache_bytes(self, rows: int, capacity: int) -> int:
        ff = self.ff
        return BatchKVCache.nbytes(len(ff.layers), ff.n_kv, ff.head_dim, rows, capacity, self.cache_dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ff.logits(hidden)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, offsets: torch.Tensor, cache: BatchKVCache, rows: slice, *,
                 block: torch.Tensor | None = None, causal: bool = False, lora=None,
                 lora_rows: slice | None = None, join: Join | None = None):
        """Final hidden states [R, q, H] of `tokens` [R, q] of cache rows `rows` at positions
        lengths + `offsets` [R, q]. Lengths do not move (the caller commits per row).

        `block` [R, q, q] float additive among each row's new tokens (None: all see each other);
        `causal=True` with no block: lower-triangular (a prefill). `lora` adds its delta on `lora_rows`.

        `join` (the exact formats; the decoder sends one where `joins`): a prompt chunk for other
        cache rows, run in the same weight matmuls (its rows only pay their arithmetic, not another
        pass over the weights); each row's attention and K/V are its own, so every row's bits are
        those of its separate forward. Returns (hidden [R, q, H], the chunk's [k, c, H]) then."""
        ff = self.ff
        seg = self._segment(tokens, offsets, cache, rows, block, causal, 0)
        h = F.embedding(tokens.to(ff.embed.device), ff.embed)
        if join is None:
            return ff.layers_forward(tokens, h, seg.positions, seg.attend, lora, lora_rows, end=seg.end)
        if not ff.exact:
            raise ValueError("a joining chunk runs in a round's forward in the exact formats only")
        k, c = join.tokens.shape
        tail = self._segment(join.tokens, torch.arange(c).expand(k, c), cache, join.rows, None, True, 1)
        R, q = tokens.shape
        M0, heads, D = R * q, ff.n_heads + 2 * ff.n_kv, ff.head_dim

        def attend(i, dev, qs, ks, vs, fused):  # every row's heads flat: each segment attends on its own
            a0 = seg.attend(i, dev, None, None, None, fused=fused[:M0].view(R, q, heads, D))
            a1 = tail.attend(i, dev, None, None, None, fused=fused[M0:].view(k, c, heads, D))
            return torch.cat([a0.reshape(M0, -1), a1.reshape(k * c, -1)])

        th = F.embedding(join.tokens.reshape(-1).to(ff.embed.device), ff.embed)
        hidden, rest = ff.layers_forward(tokens, h, seg.positions, attend, lora, lora_rows,
                                         tail=(th, tail.positions.reshape(-1)), end=max(seg.end, tail.end))
        return hidden, rest.view(k, c, -1)

    @property
    def joins(self) -> bool:
        """A prompt's chunk can ride in a round's forward (`join=`): the exact formats, whose rows
        are bitwise the same in any batch, except where rounds run all their layers in one C call
        (w4a8 on a CPU, `FastForward.one_call`): a riding chunk would put the round back on the
        Python layer loop, which cost more than a chunk's forward of its own (many clients at once
        through the server: lower throughput and later first tokens; `docs/results.md`)."""
        return self.ff.exact and not self.ff.one_call()

    def _segment(self, tokens, offsets, cache: BatchKVCache, rows: slice, block, causal: bool, index: int):
        """One block of cache rows of a forward: its positions, their bound and its `attend`, from
        host data alone (the cache lengths are Python ints): nothing here waits on a device."""
        ff = self.ff
        R, q = tokens.shape
        starts = cache.lengths[rows]
        if len(starts) != R:
            raise ValueError(f"{R} token rows for {len(starts)} cache rows")
        cache.reserve(max(starts) + q)  # a round wider than the rows' reserved scratch grows the cache first
        # one row: its positions without a tensor of its length (a decode round's Python is a real
        # share of its time, most of it small torch calls like these)
        positions = ((offsets + starts[0]).long() if R == 1 else
                     torch.tensor(starts, dtype=torch.long, device=offsets.device)[:, None] + offsets)
        # the RoPE tables' length: every layout's offsets are below its width; offsets on the host
        # are read there (free, and a caller may place its tokens further out: positions past the
        # original context in a short cache); on a device they stay there (a CUDA graph's inputs)
        end = max(starts) + q
        if positions.device.type == "cpu":
            end = max(end, int(positions.numpy().max()) + 1)
        # one row needs no prefix mask (it may see every slot below its own new tokens): a lone
        # prefill takes SDPA's causal path, and new tokens that all see each other need no mask at all
        use_causal = causal and R == 1 and starts[0] == 0 and not ff.exact
        no_mask = R == 1 and not causal and block is None
        masks = {}
        mask_dtype = torch.float64 if ff.exact else ff.dtype

        def mask_on(dev):
            if dev not in masks:
                if use_causal or no_mask:
                    masks[dev] = None
                else:
                    full = block if block is not None else own_block(R, q, causal)
                    if R == 1:  # the request's reused buffer: O(q^2) mask work however long the prefix
                        buf = mask_buffer(cache.scratch, dev, mask_dtype, index)
                        masks[dev] = buf.view(starts[0], full[0].to(dev, mask_dtype))
                    else:
                        masks[dev] = batch_mask(starts, full, mask_dtype).to(dev)
            return masks[dev]

        def attend(i, dev, qs, ks, vs, fused=None):
            if ff.exact:  # q, k and v come fused, on the grid already (the RoPE tables carry its scale)
                g = ff.grids[i]  # a narrow round: stored and attended in one C call where it runs
                a = write_attend(cache, i, rows, starts, fused, ff.n_heads, mask_on(dev), g.scale, g.shift, 2.0 ** g.v)
                if a is not None:
                    return a
                qs, ks, vs = ff.split_heads(fused)
                kc, vc = cache.write(i, rows, starts, ks, vs)
                return exact_attention(qs, kc, vc, mask_on(dev), g, ff.dtype, heads_last=True)
            kc, vc = cache.write(i, rows, starts, ks, vs)
            return F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask_on(dev), is_causal=use_causal,
                                                  enable_gqa=ff.n_heads != ff.n_kv)

        if ff.exact:  # every layer in one C call where it runs (`FastForward._one_call`)
            attend.block = lambda dev: (cache, rows.start or 0, starts, mask_on(dev))
        return _Segment(positions, end, attend)


class _Segment(NamedTuple):
    positions: torch.Tensor  # [R, q], on the offsets' device
    end: int  # above every position
    attend: object  # the layer body's attend(i, dev, q, k, v, fused=)
