"""Build the C kernels once per machine with its own compiler, and load them with ctypes.

    lib = load("w4a8")      # a ctypes.CDLL, or None when there is no compiler (the caller falls back)

The source is plain C (no torch headers: it compiles in about a second) with `-march=native`,
so the library is built where it runs: the cache key is the source, the compiler, the flags and
the CPU's model and flags. OpenMP comes from the libgomp torch has already loaded (same soname),
so the kernel's threads are torch's. `SELFSPEC_NO_KERNELS=1` skips the build (the fallbacks run).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading

HERE = os.path.dirname(os.path.abspath(__file__))
# -mprefer-vector-width=512: gcc's tuning for recent Intel server CPUs vectorizes plain loops 256 bits
# wide; at 512 the exact softmax's exponentials run twice as wide (a 3,000-token prefill 5.3-5.7 ->
# 4.5-4.6 s on a 2-core Xeon with AMX). The bits do not move: the `omp simd` reductions are maxima
# and exact integer sums, and without -ffast-math gcc reorders no other float sum.
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno",
         "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
_loaded: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}
_lock = threading.Lock()


def kernel_dir() -> str:
    base = os.environ.get("SELFSPEC_CACHE")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "selfspec")
    return os.path.join(base, "kernels")


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def cpu() -> str:
    """The CPU's "model name" and "flags" lines of /proc/cpuinfo ("" where there is none)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line
                elif line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        pass
    return model + flags


def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel `name` (`<name>.c` beside this file), built now if needed; None when it
    cannot be built here (`error(name)` says why)."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]


def error(name: str) -> str | None:
    return _errors.get(name)


def sources_key() -> str:
    """A digest of every kernel source beside this file (C and the Python that dispatches to it: a
    threshold such as `attn16.DIRECT_MAX` moves times too) and whether kernels are off: measurements
    cached per machine (the weight-format choice, the cost model) are keyed by it, so a kernel
    that changes (a new vector path) is measured again instead of judged by its predecessor's times."""
    return hashlib.sha1(os.environ.get("SELFSPEC_NO_KERNELS", "").encode() + _sources(".c", ".h", ".py")).hexdigest()[:12]


def _sources(*suffixes: str) -> bytes:
    """The names and contents of the files beside this one ending in `suffixes`, in name order."""
    out = b""
    for name in sorted(f for f in os.listdir(HERE) if f.endswith(suffixes)):
        with open(os.path.join(HERE, name), "rb") as f:
            out += name.encode() + f.read()
    return out


def compile_c(cc: str, src: str, out: str, flags: list[str]) -> str | None:
    """Compile `src` into the shared library `out`; the compiler's complaint, or None."""
    res = subprocess.run([cc, *flags, src, "-o", out, "-lm"], capture_output=True, text=True, timeout=300)
    return None if res.returncode == 0 else f"{cc} failed: {res.stderr.strip()[-800:]}"


def _build(name: str) -> ctypes.CDLL | None:
    if os.environ.get("SELFSPEC_NO_KERNELS"):
        _errors[name] = "SELFSPEC_NO_KERNELS is set"
        return None
    cc = compiler()
    if cc is None:
        _errors[name] = "no C compiler (cc, gcc or clang) on PATH"
        return None
    src = os.path.join(HERE, f"{name}.c")
    with open(src, "rb") as f:
        code = f.read()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        _errors[name] = f"{cc} --version failed: {e}"
        return None
    # the headers it may include are part of what is built
    key = hashlib.sha1(code + _sources(".h") + version.encode() + " ".join(FLAGS).encode() + cpu().encode()
                       ).hexdigest()[:16]
    out = os.path.join(kernel_dir(), f"{name}-{key}.so")
    if not os.path.isfile(out):
        print(f"selfspec: building the {name} kernel with {os.path.basename(cc)} (once per machine)", file=sys.stderr)
        try:
            os.makedirs(kernel_dir(), exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=kernel_dir())
            os.close(fd)
            err = compile_c(cc, src, tmp, FLAGS)
            if err:
                os.unlink(tmp)
                _errors[name] = err
                return None
            os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
        except (OSError, subprocess.SubprocessError) as e:
            _errors[name] = f"building in {kernel_dir()} failed: {e}"
            return None
    try:
        import torch  # noqa: F401  (its libgomp first: the kernel shares torch's OpenMP runtime)
        return ctypes.CDLL(out)
    except OSError as e:
        _errors[name] = f"loading {out} failed: {e}"
        return None
