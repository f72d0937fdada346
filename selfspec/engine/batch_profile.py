"""The cost profile's batch axis: how long one batched forward of B rows x q query tokens takes.

A batch planner (`batch_planner.py`) weighs B rows' expected tokens against f(B, q): on a
memory-bound GPU a batch of 16 costs about what one row costs, on a CPU the cost grows with
B x q almost linearly, so the layout that wins at B = 1 may lose at B = 16. Measured on the
device, model and dtype in use (first batched `plan="auto"` run; a progress bar; about 30 s
on a 2-core CPU) and cached beside the batch-1 profile (`profile.default_path` + "-batch").

File format (JSON):

    {"format": "selfspec-batch-profile/1", "device": ..., "model": ..., "dtype": ...,
     "c": 256,                        # cached tokens per row while measuring
     "b": [1, 2, 4, 8, 16],           # rows, ascending
     "q": [1, 2, 4, 8, 16, 32],       # query tokens per row, ascending
     "seconds": [[...], ...]}         # seconds[i][j]: one forward of b[i] rows x q[j] tokens

Between grid points the cost is interpolated linearly in q and in B, beyond them extrapolated
from the last two points; measured costs are made non-decreasing in q and in B.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from selfspec.engine.profile import (best_of_sweeps, check_origin, default_path, device_key, grid_ok, interp2,
                                     model_key, read_json, save_json)

FORMAT = "selfspec-batch-profile/1"
GRID_B = (1, 2, 4, 8, 16)
GRID_Q = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class BatchProfile:
    device: str
    model: str
    dtype: str
    b: tuple[int, ...]
    q: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    c: int = 256
    source: str = "<memory>"

    def __post_init__(self):
        if not (grid_ok(self.b, self.q, self.seconds) and all(x >= 1 for x in self.b + self.q)):
            raise ValueError(f"{self.source}: not a valid batch cost profile (b and q ascending, seconds[b][q] "
                             f"positive and finite, one row per b and one column per q)")

    def __call__(self, B: int, q: int) -> float:
        """Predicted seconds of one forward of B rows x q query tokens."""
        return max(1e-9, interp2(self.b, self.q, self.seconds, B, q))

    @classmethod
    def flat(cls, seconds: float = 1e-3) -> "BatchProfile":
        """Every forward costs the same (a memory-bound GPU's picture; for tests and what-if planning)."""
        return cls("synthetic", "*", "any", (1, 1024), (1, 1024), ((seconds,) * 2,) * 2, source="<flat>")

    @classmethod
    def linear(cls, per_token: float = 1e-3, fixed: float = 0.0) -> "BatchProfile":
        """Cost fixed + per_token x B x q: a compute-bound device's picture (for tests)."""
        b = q = (1, 1024)
        return cls("synthetic", "*", "any", b, q, tuple(tuple(fixed + per_token * x * y for y in q) for x in b),
                   source="<linear>")

    def to_json(self) -> dict:
        return {"format": FORMAT, "device": self.device, "model": self.model, "dtype": self.dtype, "c": self.c,
                "b": list(self.b), "q": list(self.q), "seconds": [list(r) for r in self.seconds]}

    @classmethod
    def load(cls, path: str, *, device: str | None = None, model: str | None = None,
             dtype: str | None = None) -> "BatchProfile":
        """Read a batch profile; every problem is a ValueError / FileNotFoundError naming the file."""
        raw = read_json(path, FORMAT, "batch cost profile")
        try:
            prof = cls(str(raw["device"]), str(raw["model"]), str(raw["dtype"]), tuple(int(x) for x in raw["b"]),
                       tuple(int(x) for x in raw["q"]), tuple(tuple(float(s) for s in r) for r in raw["seconds"]),
                       int(raw.get("c", 256)), path)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise
            raise ValueError(f"batch cost profile {path}: missing or malformed field ({e})") from None
        check_origin(prof, path, "batch cost profile", device=device, model=model, dtype=dtype)
        return prof

    def save(self, path: str) -> None:
        save_json(path, self.to_json())


def _monotone(rows: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    """Non-decreasing along q (within a row) and along B (down the columns)."""
    out = [list(r) for r in rows]
    for i, r in enumerate(out):
        for j in range(len(r)):
            r[j] = max(r[j], r[j - 1] if j else 0.0, out[i - 1][j] if i else 0.0)
    return tuple(tuple(r) for r in out)


@torch.inference_mode()
def measure_batch(model, *, grid_b=GRID_B, grid_q=GRID_Q, c: int = 256, sweeps: int = 4, budget_s: float = 30.0,
                  progress: bool = True) -> BatchProfile:
    """Time batched forwards (`batch_forward.BatchForward`) over the grid: the fastest of a few
    sweeps per point (`profile.best_of_sweeps`)."""
    from selfspec.engine.batch_forward import BatchForward

    bf = BatchForward.of(model)
    c = min(c, max(1, model.config.max_position_embeddings - max(grid_q) - 1))
    cache = bf.new_cache(max(grid_b), c + max(grid_q) + 1)
    gen = torch.Generator().manual_seed(0)
    V = model.config.vocab_size
    prefix = torch.randint(0, V, (1, c), generator=gen)
    bf(prefix, torch.arange(c)[None], cache, slice(0, 1), causal=True)
    cache.lengths[0] = c
    for r in range(1, max(grid_b)):  # every row holds the same prefix: copy row 0 instead of running it again
        cache.move(0, r, keep=True)
    points = [(B, q) for B in grid_b for q in grid_q]
    inputs = {(B, q): (torch.randint(0, V, (B, q), generator=gen),
                       torch.full((q, q), float("-inf")).triu_(1).expand(B, q, q)) for B, q in points}

    def run(point):
        B, q = point
        toks, block = inputs[point]
        h = bf(toks, torch.arange(q).expand(B, q), cache, slice(0, B), block=block)
        bf.logits(h[:, : min(q, 16)].reshape(-1, h.shape[-1]))
        if h.is_cuda:
            torch.cuda.synchronize(h.device)

    times = best_of_sweeps(points, run, sweeps=sweeps, budget_s=budget_s, desc="measuring the batch cost profile",
                           progress=progress)
    best = [times[i * len(grid_q):(i + 1) * len(grid_q)] for i in range(len(grid_b))]
    dev = model.get_input_embeddings().weight.device
    return BatchProfile(device_key(dev), model_key(model), str(model.dtype).replace("torch.", ""), tuple(grid_b),
                        tuple(grid_q), _monotone(best), c)


def batch_path(model) -> str:
    return default_path(model)[: -len(".json")] + "-batch.json"


def is_batch_profile(profile) -> bool:
    """Whether `profile` (an object, or a path to one) is a batch cost profile: a batch of one row
    given one plans with the batch planner. A file that cannot be read is not one (the loader
    that reads it next names its problem)."""
    if isinstance(profile, BatchProfile):
        return True
    if not isinstance(profile, (str, os.PathLike)):
        return False
    try:
        with open(profile, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT


def batch_cost_model(model, profile=None) -> BatchProfile:
    """The batch profile to plan with: the given one (object or path), else the cached one, else
    measured now and cached (an unwritable cache keeps it in memory, with one warning)."""
    import warnings

    if isinstance(profile, BatchProfile):
        return profile
    dev = model.get_input_embeddings().weight.device
    want = dict(device=device_key(dev), model=model_key(model), dtype=str(model.dtype).replace("torch.", ""))
    if profile is not None:
        return BatchProfile.load(os.fspath(profile), **want)
    memo = getattr(model, "_selfspec_batch_profile", None)
    if memo is not None and memo[0] == want:
        return memo[1]
    path = batch_path(model)
    prof = None
    if os.path.isfile(path):
        try:
            prof = BatchProfile.load(path, **want)
        except (ValueError, FileNotFoundError):
            prof = None
    if prof is None:
        prof = measure_batch(model)
        try:
            prof.save(path)
        except OSError as e:
            warnings.warn(f"the batch cost profile could not be cached at {path} ({e}); it is used from memory",
                          stacklevel=2)
    model._selfspec_batch_profile = (want, prof)
    return prof
