"""The test matrix, named once: the weight formats and KV caches the exactness tests run over.

`FORMATS` every weight format; `EXACT` the formats whose rows are bitwise the same in any batch,
width or chunking (a float format is not: fp32 and bf16 on a GPU); `+kv8` a format with K and V
cached as int8 (`kv_cache_dtype="int8"`) instead of int16.
"""

from __future__ import annotations

import torch

from selfspec.checkpoint.quant import FORMATS
from selfspec.engine.measure import formats
from selfspec.engine.forward.batch_forward import BatchForward, set_kv_cache_dtype

EXACT = tuple(f for f in FORMATS if f != "fp32")
EXACT_KV8 = EXACT + tuple(f + "+kv8" for f in EXACT)  # every exact format with either cache
FORMATS_KV8 = ("fp32",) + EXACT_KV8

__all__ = ["EXACT", "EXACT_KV8", "FORMATS", "FORMATS_KV8", "set_weights"]


def set_weights(m, fmt: str):
    """`fmt` ("w4a8", or "w4a8+kv8": with K and V cached as int8) put on m."""
    name, _, kv = fmt.partition("+")
    m = formats.set_weights(m, name)
    if kv:
        set_kv_cache_dtype(m, "int8")
        assert BatchForward.of(m).new_cache(1, 4).k[0].dtype == torch.int8
    return m
