"""Cost profiles: how long one forward of q query tokens over c cached tokens takes here.

    python -m selfspec profile [--model DIR] [--device cuda] [--dtype bfloat16] [--out FILE]

A GPU's forward costs the same for 1 and for hundreds of query tokens; a CPU's grows with q
(measured on the project's 2-core machine: f(16) = 1.7 f(1), f(544) = 15 f(1)). The planner
reads this curve to choose each round's layout, so it is measured on the device, model and
dtype in use, over a small grid, and cached in the user's cache folder
(`$SELFSPEC_CACHE`, else `$XDG_CACHE_HOME/selfspec`, else `~/.cache/selfspec`), keyed by
device, model and dtype. The first `plan="auto"` generation measures it (a progress bar on
stderr; under 20 s on a CPU).

File format (JSON; a synthetic profile can be written by hand):

    {"format": "selfspec-profile/1",
     "device": "cpu: AMD EPYC x2 threads",      # `device_key()` of where it was measured
     "model": "3f2a...",                         # `model_key()`; "*" matches any model
     "dtype": "float32",
     "q": [1, 2, 4, ...],                        # query tokens per forward, ascending
     "c": [64, 1024],                            # cached tokens, ascending
     "seconds": [[...], [...]]}                  # seconds[i][j]: forward of q[j] over c[i]

Between grid points the cost is interpolated linearly (in q and in c), beyond them
extrapolated from the last two points. Each measured point is a forward over q new tokens with
a dense tree mask plus the output head on min(q, 48) rows (a round reads the tree's rows and
one group's), the fastest of five sweeps over the grid, made non-decreasing in q.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import threading
import time
import warnings
from bisect import bisect_left
from dataclasses import dataclass

import torch

FORMAT = "selfspec-profile/1"
GRID_Q = [1, 2, 4, 8, 16, 32, 64, 128, 256, 576]
GRID_C = [64, 1024]


@dataclass(frozen=True)
class CostProfile:
    device: str
    model: str
    dtype: str
    q: tuple[int, ...]
    c: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    source: str = "<memory>"

    def __post_init__(self):
        ok = grid_ok(self.c, self.q, self.seconds) and all(q >= 1 for q in self.q) and all(c >= 0 for c in self.c)
        if not ok:
            raise ValueError(f"{self.source}: not a valid cost profile (q and c must be ascending, seconds[c][q] "
                             f"positive and finite, one row per c and one column per q)")

    def __call__(self, q: int, c: int) -> float:
        """Predicted seconds of one forward of q query tokens over c cached tokens."""
        return max(1e-9, interp2(self.c, self.q, self.seconds, c, q))

    @classmethod
    def flat(cls, seconds: float = 1e-3, *, max_q: int = 1024) -> "CostProfile":
        """A GPU-like profile: every forward costs the same (for tests and what-if planning)."""
        return cls("synthetic", "*", "any", (1, max_q), (0,), ((seconds, seconds),), "<flat>")

    def to_json(self) -> dict:
        return {"format": FORMAT, "device": self.device, "model": self.model, "dtype": self.dtype,
                "q": list(self.q), "c": list(self.c), "seconds": [list(r) for r in self.seconds]}

    @classmethod
    def load(cls, path: str, *, device: str | None = None, model: str | None = None, dtype: str | None = None) -> "CostProfile":
        """Read a profile file; every problem is a ValueError / FileNotFoundError naming the file."""
        raw = read_json(path, FORMAT, "cost profile")
        try:
            prof = cls(str(raw["device"]), str(raw["model"]), str(raw["dtype"]), tuple(int(x) for x in raw["q"]),
                       tuple(int(x) for x in raw["c"]), tuple(tuple(float(s) for s in r) for r in raw["seconds"]), path)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise
            raise ValueError(f"cost profile {path}: missing or malformed field ({e})") from None
        check_origin(prof, path, "cost profile", device=device, model=model, dtype=dtype)
        return prof

    def save(self, path: str) -> None:
        save_json(path, self.to_json())


# -- shared by the batch-1 and the batch profile (`batch_profile.BatchProfile`) ---------------------
def grid_ok(rows, cols, seconds) -> bool:
    """Both axes ascending without repeats, one row per `rows` entry and one column per `cols`
    entry, every time positive and finite."""
    return (len(rows) >= 1 and len(cols) >= 1 and len(seconds) == len(rows)
            and all(len(r) == len(cols) for r in seconds)
            and list(rows) == sorted(set(rows)) and list(cols) == sorted(set(cols))
            and all(isinstance(s, (int, float)) and s == s and 0 < s < float("inf") for r in seconds for s in r))


def interp2(rows, cols, seconds, r: float, c: float) -> float:
    """seconds[.][.] at (r, c): linear along each row in `cols`, then across rows in `rows`."""
    return _interp(rows, [_interp(cols, row, c) for row in seconds], r)


def read_json(path: str, fmt: str, what: str) -> dict:
    """A profile file's JSON object; a missing, unreadable or foreign file is one error naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{what} {path} cannot be read: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != fmt:
        raise ValueError(f"{what} {path}: expected \"format\": \"{fmt}\"")
    return raw


def check_origin(prof, path: str, what: str, **want) -> None:
    """A profile measured for another device, model or dtype is refused (synthetic ones match any)."""
    for name, value in want.items():
        have = getattr(prof, name)
        if value is not None and have not in ("*", "any", "synthetic") and have != value:
            raise ValueError(f"{what} {path} was measured for {name} {have!r}, not this {name} ({value!r})")


def save_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(path + ".tmp", path)


def best_of_sweeps(points: list, run, *, sweeps: int, budget_s: float, desc: str, progress: bool) -> list[float]:
    """The fastest time of `run(point)` per point over a warm-up sweep and then `sweeps` timed
    ones (fewer, at least 2, when one sweep is slow against `budget_s`). Interference from other
    work only ever adds time, so the minimum is the device's own cost, and sweeping spreads a
    burst of interference over the grid instead of one point."""
    from tqdm import tqdm

    best = [float("inf")] * len(points)
    bar = tqdm(total=(sweeps + 1) * len(points), desc=desc, file=sys.stderr, disable=not progress, leave=False)
    sweep, total = 0, sweeps + 1
    while sweep < total:
        t_sweep = time.perf_counter()
        for i, point in enumerate(points):
            t0 = time.perf_counter()
            run(point)
            if sweep:  # sweep 0 warms up
                best[i] = min(best[i], time.perf_counter() - t0)
            bar.update(1)
        if sweep == 0:
            total = 1 + max(2, min(sweeps, int(budget_s / max(1e-9, time.perf_counter() - t_sweep)) - 1))
            bar.total = total * len(points)
            bar.refresh()
        sweep += 1
    bar.close()
    return best


def _interp(xs, ys, x: float) -> float:
    if len(xs) == 1:
        return float(ys[0])
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{device.type}: {cpu} x{torch.get_num_threads()} threads"


def model_key(model) -> str:
    cfg = model.config
    fields = {k: getattr(cfg, k, None) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")}
    return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> str:
    base = os.environ.get("SELFSPEC_CACHE")
    if not base:
        base = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "selfspec")
    return os.path.join(base, "profiles")


def default_path(model) -> str:
    dev = model.get_input_embeddings().weight.device
    dtype = str(model.dtype).replace("torch.", "")
    key = hashlib.sha1(f"{device_key(dev)}|{model_key(model)}|{dtype}".encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{key}.json")


@torch.inference_mode()
def measure(model, *, grid_q=GRID_Q, grid_c=GRID_C, sweeps: int = 5, budget_s: float = 20.0,
            progress: bool = True) -> CostProfile:
    """Time the runtime's one-row forward (`batch_forward.BatchForward`, as a batch-1 generation
    runs it) over the grid on the model's own device and dtype.

    Each point keeps its fastest time over `sweeps` sweeps of the grid (`best_of_sweeps`).
    Costs are then made non-decreasing in q (more query tokens never cost less). A model whose
    sweep is slow (135M parameters on 2 CPU cores: ~4 s) gets fewer sweeps, at least 2, so that
    the whole measurement stays near `budget_s`.
    """
    from selfspec.engine.batch_forward import BatchForward

    bf = BatchForward.of(model)
    limit = model.config.max_position_embeddings
    grid_c = sorted({min(c, max(0, limit - max(grid_q) - 1)) for c in grid_c})
    dev = model.get_input_embeddings().weight.device
    cache = bf.new_cache(1, max(grid_c) + max(grid_q) + 1)
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prefix = torch.randint(0, V, (1, max(grid_c)), generator=gen)
    if prefix.numel():
        bf(prefix, torch.arange(prefix.shape[1])[None], cache, slice(0, 1), causal=True)
    points = [(i, j) for i in range(len(grid_c)) for j in range(len(grid_q))]
    inputs = {}
    for _, j in points:
        q = grid_q[j]
        inputs[j] = (torch.randint(0, V, (1, q), generator=gen),
                     torch.full((q, q), float("-inf")).triu_(1)[None] if q > 1 else None)

    def run(point):
        i, j = point
        c, q = grid_c[i], grid_q[j]
        cache.lengths[0] = c
        toks, block = inputs[j]
        h = bf(toks, torch.arange(q)[None], cache, slice(0, 1), block=block)
        bf.logits(h[0, : min(q, 48)])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    times = best_of_sweeps(points, run, sweeps=sweeps, budget_s=budget_s, desc="measuring the cost profile",
                           progress=progress)
    best = [times[i * len(grid_q):(i + 1) * len(grid_q)] for i in range(len(grid_c))]
    rows = []
    for row in best:
        mono, top = [], 0.0
        for v in row:
            top = max(top, v)
            mono.append(top)
        rows.append(tuple(mono))
    return CostProfile(device_key(dev), model_key(model), str(model.dtype).replace("torch.", ""),
                       tuple(grid_q), tuple(grid_c), tuple(rows))


_MEASURE_LOCK = threading.Lock()


def cost_model(model, profile=None) -> CostProfile:
    """The profile to plan with: the given one (object or path), else the cached one, else measured.

    A cached profile that cannot be read or belongs elsewhere is measured again; a cache folder
    that cannot be written leaves the profile in memory with one warning.
    """
    if isinstance(profile, CostProfile):
        return profile
    dev = model.get_input_embeddings().weight.device
    want = dict(device=device_key(dev), model=model_key(model), dtype=str(model.dtype).replace("torch.", ""))
    if profile is not None:
        return CostProfile.load(os.fspath(profile), **want)
    memo = getattr(model, "_selfspec_profile", None)
    if memo is not None and memo[0] == want:
        return memo[1]
    with _MEASURE_LOCK:  # threads starting at once measure (and write the cache) once
        memo = getattr(model, "_selfspec_profile", None)
        if memo is not None and memo[0] == want:
            return memo[1]
        return _cached_or_measured(model, want)


def _cached_or_measured(model, want: dict) -> CostProfile:
    path = default_path(model)
    prof = None
    if os.path.isfile(path):
        try:
            prof = CostProfile.load(path, **want)
        except (ValueError, FileNotFoundError):
            prof = None  # automatic profile: measure again
    if prof is None:
        prof = measure(model)
        try:
            prof.save(path)
        except OSError as e:
            warnings.warn(f"the cost profile could not be cached in {os.path.dirname(path)} ({e}); "
                          f"it is used from memory for this process", stacklevel=3)
    model._selfspec_profile = (want, prof)
    return prof
