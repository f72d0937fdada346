"""What a measurement was taken for: the device (its CPU model and widest vector ISA, or its GPU,
and the threads), the model's shape, its dtype and weight format, and the folder where such
measurements are cached. The cost model (`cost.py`) and the weight-format choice (`formats.py`)
key their cached files by these, so a file measured elsewhere is never read here.

Example: `device_key(torch.device("cpu"))` -> "cpu: Intel(R) Xeon(R) ... (amx_bf16) x2 threads"."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform

import torch


def device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu, isa = _cpu_name()
    return f"{device.type}: {cpu}{f' ({isa})' if isa else ''} x{torch.get_num_threads()} threads"


@functools.lru_cache(maxsize=1)
def _cpu_name() -> tuple[str, str | None]:
    """The CPU's model name and its widest vector ISA (read once: asked at every generation)."""
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first processor's block says it all
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    # a name such as "AMD EPYC" covers CPUs whose kernels differ in speed and in width invariance
    # (native bf16 dot products reduce in another order): the widest vector ISA tells them apart
    return cpu, next((f for f in ISA_LEVELS if f in flags), None)


ISA_LEVELS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")  # most capable first


def model_key(model) -> str:
    cfg = model.config
    fields = {k: getattr(cfg, k, None) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def weights_name(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def identity(model, ff=None) -> dict:
    """What a cost model must have been measured for: this device, model, dtype and weight format
    (`ff`: the model's `FastForward` when the caller has it; finding it walks every parameter)."""
    from selfspec.engine.forward.forward import FastForward

    ff = ff or FastForward.of(model)
    dtype = str(ff.dtype).replace("torch.", "")
    kv = model.__dict__.get("selfspec_kv_cache", "int16")  # a one-byte cache reads long contexts faster
    weights = ff.weights if kv == "int16" or not ff.exact else f"{ff.weights}, {kv} KV cache"
    return dict(device=device_key(ff.devices[0]), model=model_key(model), dtype=dtype, weights=weights)


def cache_dir() -> str:
    base = os.environ.get("SELFSPEC_CACHE")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "selfspec")
    return os.path.join(base, "profiles")
