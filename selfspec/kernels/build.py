"""Build the C kernels once per machine with its own compiler, and load them with ctypes.

    lib = load("w4a8")      # a ctypes.CDLL, or None where it cannot be built (the caller falls back)
    state()                 # what loaded, built for which CPU, or why not (`selfspec info`, bench)

The source is plain C (no torch headers: it compiles in about a second) built for the CPU it runs
on (`flag_sets`: -march=native on x86-64, -mcpu=native on ARM, portable C elsewhere), so the cache
key is the source, the compiler, the flags and the CPU's model and flags. A cached library is
checked against the record of its build before it is mapped and built again where it does not
match; a folder others could write is not loaded from (`cache`). Where a kernel cannot be built or
loaded, one warning a process says why and what fixes it, and a failed build is remembered on disk
until the sources, the compiler or the CPU change. OpenMP comes from the libgomp torch has already
loaded (same soname), so the kernel's threads are torch's. `SELFSPEC_NO_KERNELS=1` skips the build
(the fallbacks run).
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading

from selfspec.kernels import cache

HERE = os.path.dirname(os.path.abspath(__file__))
_COMMON = ["-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared", "-fPIC"]
FIX_CC = "install a C compiler with OpenMP (e.g. apt-get install gcc), or point CC at one"
TIMEOUT_S = 300
_loaded: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}
_fixes: dict[str, str] = {}
_records: dict[str, dict] = {}
_warned: set[str] = set()
_private: dict[str, str] = {}  # kernel folder that cannot be used -> this process's own folder
_versions: dict[str, str | None] = {}
_failed_once = False  # after a failed build this process builds the rest without a line each
_lock = threading.Lock()


def flag_sets(machine: str | None = None) -> list[list[str]]:
    """The compiler flags to try in turn on CPU architecture `machine` (this one's by default):
    tuned for this CPU first, then plainer ones a compiler may accept where it rejects the tuning.
    The C has vector paths for x86 only; elsewhere its portable loops build."""
    m = (machine or platform.machine()).lower()
    if m in ("x86_64", "amd64", "i386", "i686"):
        # 512 bits: gcc's tuning for recent Intel server CPUs vectorizes plain loops 256 bits wide,
        # and the exact softmax's exponentials run twice as wide at 512 (docs/results.md, "Prefill:
        # the kernels built 512 bits wide"). The bits do not move: the `omp simd` reductions are
        # maxima and exact integer sums, and without -ffast-math gcc reorders no other float sum.
        tuned = [["-march=native", "-mprefer-vector-width=512"], []]
    elif m in ("aarch64", "arm64"):
        tuned = [["-mcpu=native"], ["-march=armv8-a"]]
    else:
        tuned = [[]]
    return [["-O3", *t, *_COMMON] for t in tuned]


FLAGS = flag_sets()[0]


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
    """The CPU's lines of /proc/cpuinfo that name it and its instruction sets ("model name" and
    "flags" on x86, "CPU implementer", "CPU part" and "Features" on ARM; "" where there is none)."""
    want = ("model name", "flags", "CPU implementer", "CPU part", "Features")
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k = line.split(":")[0].strip()
                if k in want and k not in seen:
                    seen[k] = line
                if "flags" in seen or "Features" in seen:
                    break
    except OSError:
        pass
    return "".join(seen[k] for k in want if k in seen)


def names() -> list[str]:
    """The kernels: every `<name>.c` beside this file."""
    return sorted(f[:-2] for f in os.listdir(HERE) if f.endswith(".c"))


def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel `name` (`<name>.c` beside this file), built now if needed; None when it
    cannot be built here (`error(name)` says why)."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _build(name)
        return _loaded[name]


def error(name: str) -> str | None:
    return _errors.get(name)


def state() -> dict:
    """Each kernel's state as plain data (results files, `selfspec info`), loading them first:
    {name: {"loaded": True, "march", "isa" (the instruction sets it was compiled for), "flags",
    "path"} or {"loaded": False, "error", "fix"}}."""
    out = {}
    for name in names():
        if load(name) is not None:
            r = _records[name]
            out[name] = {"loaded": True, "march": r.get("march"), "isa": " ".join(r.get("isa") or []) or "portable C",
                         "flags": " ".join(r.get("flags") or []), "path": r["path"]}
        else:
            out[name] = {"loaded": False, "error": _errors.get(name), "fix": _fixes.get(name)}
    return out


def summary(st: dict | None = None) -> str:
    """`state()` in one line: which kernels run, built for what, or why not."""
    st = state() if st is None else st
    on = [n for n, s in st.items() if s["loaded"]]
    off = [n for n, s in st.items() if not s["loaded"]]
    parts = []
    if on:
        s = st[on[0]]
        parts.append(f"{', '.join(on)} built for {s['march'] or 'this CPU'} ({s['isa']})")
    if off:
        parts.append(f"{', '.join(off)} not loaded, torch fallback ({st[off[0]]['error']})")
    return "kernels: " + "; ".join(parts)


def sources_key() -> str:
    """A digest of every kernel source beside this file (C and the Python that dispatches to it: a
    threshold such as `attn16.DIRECT_MAX` moves times too) and of what actually loaded, built for
    which instruction sets (none with SELFSPEC_NO_KERNELS, or where a build failed): measurements
    cached per machine (the weight-format choice, the cost model) are keyed by it, so a kernel that
    changes, or that failed to build when they were measured, is measured again."""
    loaded = ";".join(f"{n}:{' '.join(_records[n].get('isa') or []) if load(n) is not None else 'none'}"
                      for n in names())
    return hashlib.sha1(os.environ.get("SELFSPEC_NO_KERNELS", "").encode() + _sources(".c", ".h", ".py")
                        + loaded.encode()).hexdigest()[:12]


def _sources(*suffixes: str) -> bytes:
    """The names and contents of the files beside this one ending in `suffixes`, in name order."""
    out = b""
    for name in sorted(f for f in os.listdir(HERE) if f.endswith(suffixes)):
        with open(os.path.join(HERE, name), "rb") as f:
            out += name.encode() + f.read()
    return out


def _cc(cc: str, args: list[str]) -> tuple[int | None, str, str]:
    """(exit status, stdout, stderr) of the compiler; status None where it did not finish (timed out,
    or could not start)."""
    try:
        res = subprocess.run([cc, *args], capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, "", f"{os.path.basename(cc)} took over {TIMEOUT_S} s"
    except OSError as e:
        return None, "", f"{cc} could not run: {e.strerror or e}"
    return res.returncode, res.stdout, res.stderr


def compile_c(cc: str, src: str, out: str, flags: list[str]) -> str | None:
    """Compile `src` into the shared library `out`; the compiler's complaint, or None."""
    rc, _, err = _cc(cc, [*flags, src, "-o", out, "-lm"])
    return None if rc == 0 else f"{cc} failed: {err.strip()[-800:]}"


def first_error(text: str) -> str:
    """The line of a compiler's output that says what went wrong: the first naming an error, else
    the first line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no message")


def _version(cc: str) -> str | None:
    if cc not in _versions:
        rc, out, err = _cc(cc, ["--version"])
        _versions[cc] = out if rc == 0 else None
    return _versions[cc]


def _target(cc: str, flags: list[str]) -> dict:
    """What `flags` compile for: the instruction-set macros the compiler defines (avx2, avx512vnni,
    amx_int8, neon, ...) and the -march / -mcpu it resolves "native" to (gcc; None elsewhere)."""
    plain = [f for f in flags if f not in ("-shared", "-fPIC", "-fopenmp")]
    rc, out, _ = _cc(cc, [*plain, "-dM", "-E", "-x", "c", os.devnull])
    wanted = ("__AVX2__", "__FMA__", "__F16C__", "__AVX512F__", "__AVX512BW__",
              "__AVX512VL__", "__AVX512VNNI__", "__AVX512BF16__", "__AMX_TILE__", "__AMX_INT8__", "__AMX_BF16__",
              "__ARM_NEON", "__ARM_FEATURE_DOTPROD", "__ARM_FEATURE_MATMUL_INT8", "__ARM_FEATURE_SVE")
    defined = {ln.split()[1] for ln in out.splitlines() if ln.startswith("#define ")} if rc == 0 else set()
    isa = [m.strip("_").lower().replace("arm_feature_", "").replace("arm_", "") for m in wanted if m in defined]
    rc, out, _ = _cc(cc, [*plain, "-Q", "--help=target"])
    march = None
    for ln in out.splitlines() if rc == 0 else []:
        parts = ln.split()
        if len(parts) == 2 and parts[0] in ("-march=", "-mcpu=") and parts[1] not in ("", "native"):
            march = march or parts[1]
    return {"isa": isa, "march": march or next((f.split("=", 1)[1] for f in flags if f.startswith(("-march", "-mcpu"))),
                                               "portable")}


def _fail(name: str, reason: str, fix: str, note: str = "") -> None:
    """Record why `name` is not loaded; one warning a process for each distinct reason (a compiler
    that fails every kernel the same way is one line, the kernel it met first named)."""
    global _failed_once
    _failed_once = True
    reason = " ".join(reason.split())
    _errors[name], _fixes[name] = reason + note, fix
    if reason not in _warned:
        _warned.add(reason)
        print(f"selfspec: warning: the {name} kernel cannot be used, so the slower torch fallback runs: {reason}"
              f"{note}. Fix: {fix}. (`python -m selfspec info` shows every kernel.)", file=sys.stderr)
    return None


def _folder() -> str:
    """The kernel cache, or where it cannot be written or could hold another user's code, a folder of
    this process's own (removed at exit; one line says why)."""
    d = kernel_dir()
    if d in _private:
        return _private[d]
    why = cache.unsafe_folder(d)
    if why is None:
        try:
            os.makedirs(d, exist_ok=True)
            with tempfile.TemporaryFile(dir=d):
                pass
            return d
        except OSError as e:
            why = f"cannot be written ({e.strerror or e})"
    else:
        why = f"is not safe to load code from: {why}"
    _private[d] = tempfile.mkdtemp(prefix="selfspec-kernels-")
    atexit.register(shutil.rmtree, _private[d], True)  # a mapped library outlives its file
    print(f"selfspec: the kernel cache {d} {why}; building the kernels in {_private[d]} for this process only "
          f"(fix: set SELFSPEC_CACHE to a folder only you can write)", file=sys.stderr)
    return _private[d]


def _build(name: str) -> ctypes.CDLL | None:
    if os.environ.get("SELFSPEC_NO_KERNELS"):
        _errors[name] = "SELFSPEC_NO_KERNELS is set"
        return None
    cc = compiler()
    if cc is None:
        return _fail(name, "no C compiler (cc, gcc or clang) on PATH", FIX_CC)
    version = _version(cc)
    if version is None:
        return _fail(name, f"{cc} --version failed", FIX_CC)
    src = os.path.join(HERE, f"{name}.c")
    with open(src, "rb") as f:
        code = f.read()
    sets = flag_sets()
    # the headers it may include are part of what is built
    key = hashlib.sha1(code + _sources(".h") + version.encode() + " ".join(sets[0]).encode() + cpu().encode()
                       ).hexdigest()[:16]
    folder = _folder()
    so = os.path.join(folder, f"{name}-{key}.so")
    failed = cache.remembered(so)
    if failed:
        return _fail(name, failed["error"], failed.get("fix") or FIX_CC,
                     f" (remembered from an earlier build; remove {os.path.join(folder, '*.failed.json')} to retry)")
    if os.path.lexists(so):
        record, why = cache.verify(so)
        if record is not None:
            return _open(name, so, record)
        print(f"selfspec: the cached {name} kernel {so} {why}; building it again", file=sys.stderr)
        try:
            cache.remove(so)
        except OSError as e:
            return _fail(name, f"the cached {so} {why} and cannot be removed ({e.strerror or e})",
                         f"remove {so} by hand")
    elif not _failed_once and folder == kernel_dir():  # a private folder's line was said by _folder
        print(f"selfspec: building the {name} kernel with {os.path.basename(cc)} (once per machine)", file=sys.stderr)
    try:
        record = _compile(name, cc, sets, so)
    except OSError as e:
        return _fail(name, f"building in {folder} failed ({e.strerror or e})",
                     "set SELFSPEC_CACHE to a writable folder with free space")
    return _open(name, so, record) if isinstance(record, dict) else None


def _compile(name: str, cc: str, sets: list[list[str]], so: str) -> dict | None:
    """Build `name` into `so` with the first flags in `sets` that compile, and record it; None (the
    failure recorded, and remembered on disk where it will recur) where none do. A build that stops
    halfway leaves no file."""
    fd, tmp = tempfile.mkstemp(prefix=f"tmp-{name}-", suffix=".so", dir=os.path.dirname(so))
    os.close(fd)
    try:
        first = None
        for flags in sets:
            rc, _, err = _cc(cc, [*flags, os.path.join(HERE, f"{name}.c"), "-o", tmp, "-lm"])
            if rc == 0:
                rec = {"name": name, "compiler": cc, "flags": flags, **_target(cc, flags)}
                return cache.install(tmp, so, rec)
            first = first or (rc, err)
        rc, err = first
        reason = f"{os.path.basename(cc)} failed: {first_error(err)}" if rc is not None else err
        if rc is not None and rc > 0 and os.path.dirname(so) == kernel_dir():  # not a timeout or a kill
            cache.remember(so, " ".join(reason.split()), FIX_CC)
        return _fail(name, reason, FIX_CC)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _open(name: str, so: str, record: dict) -> ctypes.CDLL | None:
    try:
        import torch  # noqa: F401  (its libgomp first: the kernel shares torch's OpenMP runtime)

        lib = ctypes.CDLL(so)
    except OSError as e:
        return _fail(name, f"loading {so} failed: {e}",
                     f"remove {so} to build it again; if that does not help, report it with `python -m selfspec info`")
    _records[name] = {**record, "path": so}
    return lib
