"""The cost model: how long one forward of `rows` x `width` query tokens over `cache` cached tokens
per row takes on this device, model, dtype and weight format.

    python -m selfspec profile [--model DIR] [--weights FORMAT] [--batch-size 16] [--out FILE]

A GPU's forward costs about the same for 1 and for hundreds of query tokens; a CPU's grows with
every token, and not always monotonically (a kernel may run 5 rows cheaper than 4). The planner
(`planner.py`) reads this curve to choose each round's layout and the width it pads a round to,
so it is measured here, once per device, model, dtype and weight format, and cached in the
user's cache folder (`$SELFSPEC_CACHE`, else `$XDG_CACHE_HOME/selfspec`, else
`~/.cache/selfspec`). The rows axis is measured as far as a run needs it: a single prompt measures
rows = 1, the first batch of 16 rows the rest;
both land in the same file. A progress bar shows on stderr. Times taken while other processes
kept this one's cores busy are used by that process only, never cached (`busy_elsewhere`).

File format (JSON; a synthetic one can be written by hand):

    {"format": "selfspec-cost/2",
     "device": "cpu: AMD EPYC (avx2) x2 threads",  # `device_key()`; "synthetic" matches any device
     "model": "3f2a...",                     # `model_key()`; "*" matches any model
     "dtype": "float32", "weights": "fp32",  # "any" matches any
     "rows": [1, 2, 4],                      # ascending
     "widths": [1, 2, 3, ...],               # query tokens per row, ascending
     "cache": [64, 1024],                    # cached tokens per row, ascending
     "seconds": [[[...], ...], ...]}         # seconds[i][j][k]: cache[i], rows[j], widths[k]

Between grid points the cost is interpolated linearly (in width, then rows, then cache), beyond
them extrapolated from the last two points. Points a slice does not measure (rows x width over
`TOKEN_CAP` tokens) are extrapolated in width when measuring. The older formats
("selfspec-profile/1": one row, seconds[c][q]; "selfspec-batch-profile/1": seconds[rows][q] at one
cache length) are read as they are when given as a file; cached ones are measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from bisect import bisect_left
from dataclasses import dataclass, replace

import torch

from selfspec.engine.measure.device_id import cache_dir, device_key, identity, model_key, weights_name  # noqa: F401

FORMAT = "selfspec-cost/2"
ROWS = (1, 2, 4, 8, 16, 32, 64)
WIDTHS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64, 128)
CACHE = (64, 1024)
TOKEN_CAP = 256  # rows x width measured per point beyond one row (wider points are extrapolated)
WILDCARDS = ("*", "any", "synthetic")


@dataclass(frozen=True)
class CostModel:
    device: str
    model: str
    dtype: str
    weights: str
    rows: tuple[int, ...]
    widths: tuple[int, ...]
    cache: tuple[int, ...]
    seconds: tuple  # [cache][rows][widths]
    source: str = "<memory>"

    def __post_init__(self):
        axes_ok = all(len(a) >= 1 and list(a) == sorted(set(a)) for a in (self.rows, self.widths, self.cache))
        ok = axes_ok and min(self.rows) >= 1 and min(self.widths) >= 1 and min(self.cache) >= 0
        ok = ok and len(self.seconds) == len(self.cache) and all(
            len(plane) == len(self.rows) and all(len(line) == len(self.widths) for line in plane)
            for plane in self.seconds)
        ok = ok and all(isinstance(s, (int, float)) and 0 < s < float("inf")
                        for plane in self.seconds for line in plane for s in line)
        if not ok:
            raise ValueError(f"{self.source}: not a valid cost model (rows, widths and cache ascending without "
                             f"repeats, seconds[cache][rows][width] positive and finite, one entry per grid point)")

    def __call__(self, rows: int, width: int, cache: int = 0) -> float:
        """Predicted seconds of one forward of `rows` x `width` query tokens over `cache` cached tokens."""
        planes = [_interp(self.rows, [_interp(self.widths, line, width) for line in plane], rows)
                  for plane in self.seconds]
        return max(1e-9, _interp(self.cache, planes, cache))

    @property
    def max_rows(self) -> int:
        return max(self.rows)

    def ar_steps(self, option, *, block_length: int = 16, cache: int = 64) -> float:
        """One row's round of `option` (`rounds.Option`) in AR steps of this device: f(width) (plus
        the draft pass f(block_length) of a two-pass round) over f(1). Example: on a CPU where
        f(561) = 25 f(1), PRESTO one-pass at budget 32 with a group of 16 on every node reads 25."""
        seconds = self(1, option.width, cache) + (self(1, block_length, cache) if option.draft_pass else 0.0)
        return seconds / self(1, 1, cache)

    @classmethod
    def flat(cls, seconds: float = 1e-3) -> "CostModel":
        """Every forward costs the same (a memory-bound GPU's picture; for tests and what-if planning)."""
        return cls("synthetic", "*", "any", "any", (1, 1024), (1, 1024), (0,), (((seconds,) * 2,) * 2,), "<flat>")

    @classmethod
    def linear(cls, per_token: float = 1e-3, fixed: float = 0.0, per_cached: float = 0.0) -> "CostModel":
        """fixed + per_token x rows x width (+ per_cached x rows x width x cache): a compute-bound
        device's picture (for tests)."""
        ax = (1, 1024)
        sec = tuple(tuple(tuple(fixed + r * w * (per_token + per_cached * c) for w in ax) for r in ax) for c in (0, 1024))
        return cls("synthetic", "*", "any", "any", ax, ax, (0, 1024), sec, "<linear>")

    @classmethod
    def one_row(cls, widths, seconds, cache=(0,)) -> "CostModel":
        """A synthetic one-row curve: seconds[c][w] over `cache` x `widths` (for tests)."""
        return cls("synthetic", "*", "any", "any", (1,), tuple(widths), tuple(cache),
                   tuple((tuple(line),) for line in seconds), "<one row>")

    def to_json(self) -> dict:
        return {"format": FORMAT, "device": self.device, "model": self.model, "dtype": self.dtype,
                "weights": self.weights, "rows": list(self.rows), "widths": list(self.widths),
                "cache": list(self.cache), "seconds": [[list(line) for line in plane] for plane in self.seconds]}

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(path + ".tmp", path)

    @classmethod
    def load(cls, path, *, want: dict | None = None) -> "CostModel":
        """Read a cost-model file (this format or the two older ones); every problem is one
        ValueError / FileNotFoundError naming the file. `want`: the device / model / dtype / weights
        it must have been measured for (wildcards match any)."""
        path = os.fspath(path)
        raw = _read_json(path)
        try:
            prof = _from_raw(raw, path)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise
            raise ValueError(f"cost model {path}: missing or malformed field ({e})") from None
        for name, value in (want or {}).items():
            have = getattr(prof, name)
            if value is not None and have not in WILDCARDS and have != value:
                raise ValueError(f"cost model {path} was measured for {name} {have!r}, not this {name} ({value!r})")
        return prof


def _from_raw(raw: dict, path: str) -> CostModel:
    fmt = raw.get("format")
    if fmt not in (FORMAT, "selfspec-profile/1", "selfspec-batch-profile/1"):
        raise ValueError(f"cost model {path}: expected \"format\": \"{FORMAT}\"")
    ints = lambda xs: tuple(int(x) for x in xs)  # noqa: E731
    floats = lambda xs: tuple(float(x) for x in xs)  # noqa: E731
    head = (str(raw["device"]), str(raw["model"]), str(raw["dtype"]))
    if fmt == FORMAT:
        sec = tuple(tuple(floats(line) for line in plane) for plane in raw["seconds"])
        return CostModel(*head, str(raw["weights"]), ints(raw["rows"]), ints(raw["widths"]), ints(raw["cache"]), sec, path)
    weights = "any" if head[2] == "any" else weights_name(head[2])
    if fmt == "selfspec-profile/1":  # one row: seconds[c][q]
        sec = tuple((floats(line),) for line in raw["seconds"])
        return CostModel(*head, weights, (1,), ints(raw["q"]), ints(raw["c"]), sec, path)
    if fmt == "selfspec-batch-profile/1":  # one cache length: seconds[rows][q]
        sec = (tuple(floats(line) for line in raw["seconds"]),)
        return CostModel(*head, weights, ints(raw["b"]), ints(raw["q"]), (int(raw.get("c", 256)),), sec, path)
    raise ValueError(f"cost model {path}: expected \"format\": \"{FORMAT}\"")


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"cost model {path} not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cost model {path} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"cost model {path}: expected a JSON object")
    return raw


def _interp(xs, ys, x: float) -> float:
    """Linear between grid points; below the first, the first point's value (a forward over fewer
    cached tokens or query rows never costs less than zero, as a line through two noisy points can
    say); beyond the last, the line through the last two, never below the last point."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    i = min(bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    y = float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    return max(y, float(y1)) if x > x1 else y


# -- the file's key -----------------------------------------------------------------------------------
def default_path(model) -> str:
    want = identity(model)
    from selfspec.kernels.build import sources_key

    parts = [want[k] for k in ("device", "model", "dtype", "weights")] + [sources_key()]
    key = hashlib.sha1("|".join(parts).encode()).hexdigest()[:20]
    # cost4: each point timed in its steady state (cost3 files timed f(1) right after a 128-token forward)
    return os.path.join(cache_dir(), f"{key}-cost4.json")


# -- the one way to get a cost model ------------------------------------------------------------------
_LOCK = threading.Lock()


def given_profile(model, profile, *, ff=None) -> CostModel | None:
    """A caller's `profile=`, checked without measuring anything: a `CostModel` as given, a file
    read now (one of another device, model or format is a ValueError here, before any model work),
    None as None (`cost_model` then finds or measures this device's when planning starts)."""
    if profile is None or isinstance(profile, CostModel):
        return profile
    return CostModel.load(profile, want=identity(model, ff))


def cost_model(model, profile=None, *, rows: int = 1, progress: bool = True, ff=None) -> CostModel:
    """The cost model to plan with, and the one call that may measure it: `profile` (a `CostModel`
    or a file path) as given; else this device's cached one, with its rows axis measured now as far
    as `rows` needs (and cached); a cached file that cannot be read or belongs elsewhere is
    measured again, and a cache folder that cannot be written keeps the model in memory with one
    warning. One lock: threads that start at once measure once. `ff`: the model's `FastForward`,
    when the caller has it. A decoder calls it when it starts (`Decoder.planner`), never while it
    is built."""
    if profile is not None:
        return given_profile(model, profile, ff=ff)
    want = identity(model, ff)
    with _LOCK:
        memo = model.__dict__.get("_selfspec_cost")
        if memo is not None and memo[0] == want and memo[1].max_rows >= min(rows, max(ROWS)):
            return memo[1]
        path = default_path(model)
        prof = None
        if os.path.isfile(path):
            try:
                prof = CostModel.load(path, want=want)
            except (ValueError, FileNotFoundError):
                prof = None
        need = [r for r in ROWS if prof is None or r > prof.max_rows]
        need = need[: next((i + 1 for i, r in enumerate(need) if r >= rows), len(need))]
        if need and (prof is None or prof.max_rows < rows):
            new, others = beside_others(lambda: measure(model, rows=tuple(need), progress=progress),
                                        check=want["device"].startswith("cpu"))  # a GPU's times are its own
            prof = merge_rows(prof, new)
            if others is not None:  # times taken beside other work: right for this process at most
                warnings.warn(f"other processes kept {others:.1f} of this machine's {os.cpu_count()} cores busy while "
                              f"the cost model was measured, which skews its shape: it serves this process only and "
                              f"is measured again next time (or run `python -m selfspec profile` when quiet)",
                              stacklevel=2)
            else:
                try:
                    prof.save(path)
                except OSError as e:
                    warnings.warn(f"the cost model could not be cached in {os.path.dirname(path)} ({e}); it is used "
                                  f"from memory for this process", stacklevel=2)
        model.__dict__["_selfspec_cost"] = (want, prof)
        return prof


def merge_rows(old: CostModel | None, new: CostModel) -> CostModel:
    """`new`'s rows appended to `old`'s (same widths and cache grid); old is None: new."""
    if old is None:
        return new
    if old.widths != new.widths or old.cache != new.cache:
        return new
    rows = old.rows + tuple(r for r in new.rows if r not in old.rows)
    order = sorted(range(len(rows)), key=lambda i: rows[i])
    seconds = tuple(tuple((po + pn)[i] for i in order) for po, pn in zip(old.seconds, new.seconds))
    return replace(new, rows=tuple(rows[i] for i in order), seconds=seconds)


# -- measuring ----------------------------------------------------------------------------------------
MIN_WINDOW_S = 1.0  # a shorter measurement has too few clock ticks to tell whose they were


def cpu_clocks() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds the whole machine was busy, this process's CPU seconds) now, from
    /proc/stat (busy: user, nice, system, irq, softirq and steal time); None where it cannot be read."""
    import time

    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return time.perf_counter(), busy / hz, time.process_time()


def busy_elsewhere(start, end=None) -> float | None:
    """Cores other processes kept busy since `start` (`cpu_clocks()`) when that left fewer idle cores than
    this process's threads (its times then carry their waits, unevenly); else, or when unknown, None."""
    end = end or (cpu_clocks() if start is not None else None)
    if start is None or end is None or end[0] - start[0] < MIN_WINDOW_S:
        return None
    others = max(0.0, (end[1] - start[1]) - (end[2] - start[2])) / (end[0] - start[0])
    spare = (os.cpu_count() or 1) - torch.get_num_threads()
    return others if others > spare + 0.25 else None


def beside_others(run, *, check: bool = True):
    """(run(), `busy_elsewhere` over it; None too when `check` is False)."""
    start = cpu_clocks() if check else None
    return run(), busy_elsewhere(start)


SETTLE_CALLS, TIMED_CALLS = 3, 2  # per point and sweep: untimed calls of its shape, then timed ones


def best_of_sweeps(points: list, run, *, sweeps: int, budget_s: float, desc: str, progress: bool,
                   settle: int = SETTLE_CALLS, timed: int = TIMED_CALLS, clock=None) -> list[float]:
    """The fastest time of `run(point)` per point over up to `sweeps` sweeps (fewer, at least one,
    when a sweep is slow against `budget_s`), each point in its steady state: `settle` untimed
    calls of its shape, then `timed` timed ones, in the given order (similar points adjacent): a
    forward runs slower for several calls after one of another shape, pause or not, so a point
    timed once after another shape reads too high. Interference only adds time, so the minimum is
    the device's own cost; sweeps spread a burst over the grid. The one helper that times a
    forward (`measure`, `formats._round_seconds`)."""
    import sys
    import time

    from tqdm import tqdm

    clock = clock or time.perf_counter
    best = [float("inf")] * len(points)
    bar = tqdm(total=sweeps * len(points), desc=desc, file=sys.stderr, disable=not progress, leave=False)
    sweep, total = 0, sweeps
    while sweep < total:
        t_sweep = clock()
        for i, point in enumerate(points):
            for _ in range(settle):
                run(point)
            for _ in range(timed):
                t0 = clock()
                run(point)
                best[i] = min(best[i], clock() - t0)
            bar.update(1)
        if sweep == 0:
            total = max(1, min(sweeps, int(budget_s / max(1e-9, clock() - t_sweep))))
            bar.total = total * len(points)
            bar.refresh()
        sweep += 1
    bar.close()
    return best


@torch.inference_mode()
def measure(model, *, rows=(1,), widths=None, cache=None, sweeps: int = 4, budget_s: float = 20.0,
            progress: bool = True) -> CostModel:
    """Time the runtime's forward (`batch_forward.BatchForward`, what every round runs) over the
    grid on the model's own device, dtype and weight format: per point a forward of rows x width
    new tokens under a dense tree mask plus the output head on min(width, 48) rows of each row,
    the fastest of a few sweeps, each point timed after calls of its own shape (`best_of_sweeps`).
    Points of more than `TOKEN_CAP` tokens beyond one row are extrapolated in width from the two
    widest measured ones."""
    from selfspec.engine.forward.batch_forward import BatchForward

    bf = BatchForward.of(model)
    widths, cache = tuple(widths or WIDTHS), tuple(cache or CACHE)
    limit = model.config.max_position_embeddings
    cache = tuple(sorted({min(c, max(0, limit - max(widths) - 1)) for c in cache}))
    R_max = max(rows)
    kv = bf.new_cache(R_max, max(cache) + max(widths) + 1)
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prefix = torch.randint(0, V, (1, max(cache)), generator=gen)
    if prefix.numel():
        bf(prefix, torch.arange(prefix.shape[1])[None], kv, slice(0, 1), causal=True)
    kv.set_length(0, max(cache))
    for r in range(1, R_max):  # every row holds the same prefix: copied, not run again
        kv.move(0, r, keep=True)
    # each point after a similar one: per cache and rows, the widest first (`best_of_sweeps`)
    points = [(c, R, w) for c in cache for R in rows for w in widths[::-1] if R == 1 or R * w <= TOKEN_CAP]
    tokens = {(R, w): torch.randint(0, V, (R, w), generator=gen) for _, R, w in points}
    blocks = {w: torch.full((w, w), float("-inf")).triu_(1) for w in widths}

    def run(point):
        c, R, w = point
        for r in range(R):
            kv.set_length(r, c)
        h = bf(tokens[R, w], torch.arange(w).expand(R, w), kv, slice(0, R), block=blocks[w].expand(R, w, w))
        bf.logits(h[:, : min(w, 48)].reshape(-1, h.shape[-1]))
        if h.is_cuda:
            torch.cuda.synchronize(h.device)

    times = dict(zip(points, best_of_sweeps(points, run, sweeps=sweeps, budget_s=budget_s * len(rows),
                                            desc="measuring the cost model", progress=progress)))
    seconds = tuple(tuple(_line([times.get((c, R, w)) for w in widths], widths) for R in rows) for c in cache)
    return CostModel(**identity(model), rows=tuple(rows), widths=tuple(widths), cache=cache, seconds=seconds)


def _line(values: list, widths) -> tuple[float, ...]:
    """A measured line with its unmeasured tail (None) extrapolated from the last two measured points."""
    known = [i for i, v in enumerate(values) if v is not None]
    out = list(values)
    if len(known) >= 2:
        a, b = known[-2], known[-1]
        slope = (values[b] - values[a]) / (widths[b] - widths[a])
        for i in range(b + 1, len(values)):
            out[i] = max(values[b], values[b] + slope * (widths[i] - widths[b]))
    else:
        out = [values[known[0]] * widths[i] / widths[known[0]] if v is None else v for i, v in enumerate(values)]
    return tuple(out)
