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
import sys
import time
from dataclasses import dataclass

import torch

from selfspec.engine.profile import _interp, default_path, device_key, model_key

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
        ok = (len(self.b) >= 1 and len(self.q) >= 1 and len(self.seconds) == len(self.b)
              and all(len(r) == len(self.q) for r in self.seconds)
              and list(self.b) == sorted(set(self.b)) and list(self.q) == sorted(set(self.q))
              and all(x >= 1 for x in self.b + self.q)
              and all(isinstance(s, (int, float)) and s == s and 0 < s < float("inf") for r in self.seconds for s in r))
        if not ok:
            raise ValueError(f"{self.source}: not a valid batch cost profile (b and q ascending, seconds[b][q] "
                             f"positive and finite, one row per b and one column per q)")

    def __call__(self, B: int, q: int) -> float:
        """Predicted seconds of one forward of B rows x q query tokens."""
        rows = [_interp(self.q, row, q) for row in self.seconds]
        return max(1e-9, _interp(self.b, rows, B))

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
        if not os.path.isfile(path):
            raise FileNotFoundError(f"batch cost profile {path} not found")
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"batch cost profile {path} cannot be read: {e}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"batch cost profile {path}: expected \"format\": \"{FORMAT}\"")
        try:
            prof = cls(str(raw["device"]), str(raw["model"]), str(raw["dtype"]), tuple(int(x) for x in raw["b"]),
                       tuple(int(x) for x in raw["q"]), tuple(tuple(float(s) for s in r) for r in raw["seconds"]),
                       int(raw.get("c", 256)), path)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ValueError) and str(e).startswith(path):
                raise
            raise ValueError(f"batch cost profile {path}: missing or malformed field ({e})") from None
        for name, want, have in (("device", device, prof.device), ("model", model, prof.model),
                                 ("dtype", dtype, prof.dtype)):
            if want is not None and have not in ("*", "any", "synthetic") and have != want:
                raise ValueError(f"batch cost profile {path} was measured for {name} {have!r}, not {want!r}")
        return prof

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(path + ".tmp", path)


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
    sweeps per point (interference only adds time), fewer sweeps when one is slow."""
    from tqdm import tqdm

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
    points = [(i, j) for i in range(len(grid_b)) for j in range(len(grid_q))]
    best = [[float("inf")] * len(grid_q) for _ in grid_b]
    bar = tqdm(total=(sweeps + 1) * len(points), desc="measuring the batch cost profile", file=sys.stderr,
               disable=not progress, leave=False)
    sweep, total = 0, sweeps + 1
    while sweep < total:
        t_sweep = time.perf_counter()
        for i, j in points:
            B, q = grid_b[i], grid_q[j]
            toks = torch.randint(0, V, (B, q), generator=gen)
            block = torch.full((q, q), float("-inf")).triu_(1).expand(B, q, q)
            t0 = time.perf_counter()
            h = bf(toks, torch.arange(q).expand(B, q), cache, slice(0, B), block=block)
            bf.logits(h[:, : min(q, 16)].reshape(-1, h.shape[-1]))
            if h.is_cuda:
                torch.cuda.synchronize(h.device)
            if sweep:
                best[i][j] = min(best[i][j], time.perf_counter() - t0)
            bar.update(1)
        if sweep == 0:
            total = 1 + max(2, min(sweeps, int(budget_s / max(1e-9, time.perf_counter() - t_sweep)) - 1))
            bar.total = total * len(points)
            bar.refresh()
        sweep += 1
    bar.close()
    dev = model.get_input_embeddings().weight.device
    return BatchProfile(device_key(dev), model_key(model), str(model.dtype).replace("torch.", ""), tuple(grid_b),
                        tuple(grid_q), _monotone(best), c)


def batch_path(model) -> str:
    return default_path(model)[: -len(".json")] + "-batch.json"


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
