"""Input checks that need no model: safetensors headers and device names.

Each raises one ValueError naming the file or the option, before any model work.
"""

from __future__ import annotations

import json
import os

import torch

_MAX_HEADER = 100 * 2**20  # the safetensors library's own limit on the JSON header


def check_safetensors_file(fp: str) -> None:
    """Refuse a corrupt or truncated .safetensors file from its header alone (no tensor is read).

    Layout: 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape,
    data_offsets: [begin, end]}}, then the data; the offsets are relative to the data start and
    the last one must be the data's size. Example: a file cut inside its data keeps a valid
    header whose largest end offset exceeds `size - 8 - n`, so it is reported as truncated.
    """
    size = os.path.getsize(fp)
    bad = f"{fp} is corrupt or truncated"
    if size < 8:
        raise ValueError(f"{bad}: {size} bytes, shorter than the 8-byte header length")
    with open(fp, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > _MAX_HEADER or 8 + n > size:
            raise ValueError(f"{bad}: header length {n} does not fit in the file's {size} bytes")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{bad}: the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad}: the header is not a JSON object")
    data = size - 8 - n
    end = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"{bad}: tensor {key!r} has no valid data_offsets")
        end = max(end, offsets[1])
    if end != data:
        raise ValueError(f"{bad}: the header declares {end} data bytes, the file holds {data}")


def check_safetensors_files(path: str) -> None:
    """Every .safetensors file in a checkpoint directory and its adapter folder (see above)."""
    for folder in (path, os.path.join(path, "linear_spec_lora")):
        if os.path.isdir(folder):
            for name in sorted(os.listdir(folder)):
                if name.endswith(".safetensors"):
                    check_safetensors_file(os.path.join(folder, name))


def check_device(device: str | None) -> None:
    """A device string that names a device this machine has, or a ValueError saying which exist."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; expected e.g. cpu, cuda, cuda:1, mps") from None
    have = ["cpu"]
    if torch.cuda.is_available():
        have += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        have.append("mps")
    if dev.type == "cpu" or (dev.type == "mps" and "mps" in have):
        return
    if dev.type == "cuda" and f"cuda:{dev.index or 0}" in have:
        return
    raise ValueError(f"device {device!r} does not exist on this machine; available: {', '.join(have)}")


def read_config_json(path: str, what: str = "checkpoint") -> tuple[str, dict]:
    """(path of config.json, its contents) for a checkpoint folder; one clear error if missing or not JSON."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path} has no config.json; not a {what} directory")
    with open(cfg_path) as f:
        try:
            return cfg_path, json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
