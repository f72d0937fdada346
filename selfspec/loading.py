"""`selfspec.load`: a checkpoint (or a model name) and its tokenizer, in a weight format.

    model, tok = selfspec.load()                          # the default model, weights="auto"
    model, tok = selfspec.load("pystdlib-nld-9m", weights="int8")

`weights`: "auto" (the default on a CPU: the fastest format that is exact and passes the quality
check on this device, measured once and cached; `engine.formats`), "fp32", "bf16", "int8",
"int4" or "w4a8". `$SELFSPEC_WEIGHTS` sets the default. `dtype` still names the floating-point type
of a plain load (float16 on a GPU, say); with int8 / int4 / w4a8 it must not be given (they run bf16
activations). On CUDA the default is the dtype's own (bf16).
"""

from __future__ import annotations

import gc
import os
import warnings

import torch

from selfspec.checkpoint.model import load as load_checkpoint
from selfspec.checkpoint.synthetic import is_synthetic
from selfspec.checkpoint.quant import FORMATS, INT_FORMATS

WEIGHTS = ("auto",) + FORMATS
_BY_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def load(path: str | None = None, *, weights: str | None = None, dtype: torch.dtype | str | None = None,
         device: str | None = None, device_map=None, max_memory=None, draft_lora: bool = True, progress: bool = True,
         kv_cache_dtype: str | None = None):
    """(model, tokenizer) from a checkpoint directory or a model name (`checkpoint.registry.names()`);
    no argument loads the default model (SmolLM2-135M-Instruct, converted on first use), in the
    weight format `weights` (see the module docstring). Bad arguments raise before any loading.

    `device_map` / `max_memory` go to accelerate (e.g. device_map="auto" to spread a 14B over
    several GPUs); a `linear_spec_lora/` adapter is attached for drafting unless `draft_lora=False`.
    `kv_cache_dtype`: the exact formats' KV cache, "auto" (the default, or $SELFSPEC_KV_CACHE_DTYPE:
    the one-byte cache for w4a8 and int8 weights, whose quality it keeps within issue 37's bound, int16
    for the others; `engine.batch_forward.kv_cache_for`), "int16" or "int8" (half the bytes per
    cached token; `engine.batch_forward.set_kv_cache_dtype`).
    What exists when it returns is frozen out of the cyclic garbage collector (`gc.freeze()`; see
    the comment at the end): after `from_pretrained` call `gc.freeze()` yourself to get the same.
    """
    if is_synthetic(path):
        return _load_synthetic(path, weights=weights, dtype=dtype, device=device, device_map=device_map,
                               draft_lora=draft_lora, progress=progress, kv_cache_dtype=kv_cache_dtype)
    fmt = resolve_weights(weights, dtype, device, device_map)
    kv = resolve_kv_cache(kv_cache_dtype, fmt, dtype, device, device_map)
    from selfspec.engine.measure.formats import choose, set_weights

    quantized = fmt in ("auto",) + INT_FORMATS
    model, tok = load_checkpoint(path, dtype=torch.float32 if quantized or fmt == "fp32" else dtype or fmt_dtype(fmt),
                                 device=device, device_map=device_map, max_memory=max_memory, draft_lora=draft_lora)
    named = fmt in ("bf16",) + INT_FORMATS  # "auto" only picks formats that passed the probe
    if fmt == "auto":
        fmt = choose(model, torch.tensor(_probe_ids(tok, model)), progress=progress)
    if fmt is not None:
        set_weights(model, fmt)
    return _finish(model, tok, fmt, kv, named)


def _finish(model, tok, fmt, kv, named: bool):
    """The steps after the weights exist: the invariance probe of a named format, the KV cache, gc."""
    from selfspec.engine.forward.batch_forward import kv_cache_for, set_kv_cache_dtype

    if named:
        _check_invariant(model, fmt)
    set_kv_cache_dtype(model, kv_cache_for(fmt) if kv == "auto" else kv)
    # What exists now (torch's, transformers' and the model's hundreds of thousands of objects) lives
    # as long as the model: out of the cyclic collector's sight, as the server keeps it. Otherwise a
    # full collection of them lands now and then mid-generation, a stall of many tokens' time.
    gc.collect()
    gc.freeze()
    return model, tok


def _load_synthetic(name: str, *, weights, dtype, device, device_map, draft_lora, progress, kv_cache_dtype):
    """A synthetic model (`checkpoint.synthetic`: a published shape, seeded random weights) built
    directly in a named format; "auto" has no meaning there (its quality check compares with fp32)."""
    from selfspec.checkpoint.synthetic import build, shape_of
    from selfspec.checkpoint.validate import check_device
    from selfspec.checkpoint.quant import attach

    shape_of(name)
    check_device(device)
    if device_map is not None:
        raise ValueError(f"{name}: device_map is not supported for synthetic models; give device=")
    fmt = resolve_weights(weights, dtype, device, device_map)
    if fmt == "auto":
        raise ValueError(f"{name} has random weights, so weights='auto' (the fastest format that passes a quality "
                         f"check against fp32) means nothing for it: name a format, one of {FORMATS}")
    if fmt is None:  # a GPU, or a dtype named: the dtype's own
        fmt = _BY_DTYPE.get(fmt_dtype_of(dtype) or torch.bfloat16)
        if fmt is None:
            raise ValueError(f"{name}: dtype {dtype!r} is not built for synthetic models; use float32 or bfloat16")
    kv = resolve_kv_cache(kv_cache_dtype, fmt, dtype, device, device_map)
    model, tok, packed = build(name, fmt=fmt, device=device or "cpu", draft_lora=draft_lora, progress=progress)
    if packed is not None:
        attach(model, fmt, packed)
    return _finish(model, tok, fmt, kv, named=(device or "cpu").startswith("cpu") and fmt != "fp32")


def _check_invariant(model, fmt: str) -> None:
    """A format asked for by name is probed as "auto" probes it: where this CPU's kernels make a
    row's logits depend on the round's width (bf16 on CPUs with native bf16 dot products), greedy
    output still equals AR on typical text, but not by construction; the user is told."""
    from selfspec.engine.measure.formats import invariant

    if all(p.device.type == "cpu" for p in model.parameters()) and not invariant(model):
        warnings.warn(f"weights={fmt!r}: on this CPU a row's logits are not bitwise the same at every round "
                      f"width, so greedy output equals AR's only where no near-tie falls between widths; "
                      f"weights='int4', 'w4a8' or 'int8' (or 'auto') are exact by construction here", stacklevel=3)


def resolve_weights(weights, dtype, device, device_map) -> str | None:
    """The format to load in (None: the dtype's own), or one ValueError naming the argument."""
    on_gpu = (device or "").startswith("cuda") or device_map is not None
    if weights is None:
        if dtype is not None or on_gpu:
            return None
        weights = os.environ.get("SELFSPEC_WEIGHTS") or "auto"
    if not isinstance(weights, str) or weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; expected one of {WEIGHTS}")
    if dtype is not None:
        want = fmt_dtype_of(dtype)
        if _BY_DTYPE.get(want) != weights:
            raise ValueError(f"weights={weights!r} and dtype={dtype!r} disagree; give one of them")
    if on_gpu and weights in ("auto",) + INT_FORMATS:
        if weights == "auto":
            return None
        raise ValueError(f"weights={weights!r} runs on torch's CPU kernels; use fp32 or bf16 on a GPU")
    return weights


def resolve_kv_cache(kv_cache_dtype, fmt, dtype, device, device_map) -> str:
    """The KV cache to keep ("auto": the weight format's, `kv_cache_for`, once it is known; "int16" /
    "int8"), or one ValueError before anything loads: the compact caches belong to the exact formats,
    which run on a CPU in any format but fp32."""
    from selfspec.engine.forward.batch_forward import KV_CACHE_DTYPES

    kv = kv_cache_dtype or os.environ.get("SELFSPEC_KV_CACHE_DTYPE") or "auto"
    if kv not in ("auto",) + tuple(KV_CACHE_DTYPES):
        raise ValueError(f"unknown kv_cache_dtype {kv!r}; expected one of {('auto',) + tuple(KV_CACHE_DTYPES)}")
    on_gpu = (device or "").startswith("cuda") or device_map is not None
    floaty = fmt == "fp32" or (fmt is None and fmt_dtype_of(dtype) is not torch.bfloat16)
    if kv not in ("auto", "int16") and (on_gpu or floaty):
        raise ValueError(f"kv_cache_dtype={kv!r} is a compact cache of the exact weight formats on a CPU (w4a8, "
                         f"int4, int8, bf16, or auto); {'a GPU' if on_gpu else 'fp32'} keeps a float cache")
    return kv


def fmt_dtype_of(dtype):
    return dtype if isinstance(dtype, torch.dtype) or dtype is None else getattr(torch, str(dtype), None)


def fmt_dtype(fmt: str | None):
    return {"fp32": torch.float32, "bf16": torch.bfloat16}.get(fmt)


def _probe_ids(tok, model) -> list[int]:
    from selfspec.engine.measure.formats import PROBE

    V = model.config.vocab_size
    return [t for t in tok.encode(PROBE) if 0 <= t < V][:256]
