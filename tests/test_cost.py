"""The cost model: one file format, measured on the device (its rows axis as far as a run needs
it), cached per device / model / dtype / weight format under one lock, read back with checks;
the older profile formats are read when given."""

import json
import os
import threading
import warnings

import pytest
import torch

from selfspec.engine.measure import cost
from selfspec.engine.measure.cost import FORMAT, CostModel, cost_model, default_path, device_key, measure, model_key

from conftest import tiny_model


def _model(rows=(1, 4), widths=(1, 9), cache=(0, 100)):
    """seconds = rows * width * (1 + cache / 100) / 1000."""
    sec = tuple(tuple(tuple(r * w * (1 + c / 100) / 1e3 for w in widths) for r in rows) for c in cache)
    return CostModel("d", "m", "float32", "fp32", rows, widths, cache, sec)


def test_interpolation_between_and_beyond_grid_points():
    p = _model()
    assert p(1, 5, 0) == pytest.approx(5e-3) and p(1, 1, 50) == pytest.approx(1.5e-3)
    assert p(2, 1, 0) == pytest.approx(2e-3)  # between rows 1 and 4
    assert p(1, 17, 0) == pytest.approx(17e-3)  # extrapolated from the last two widths
    assert CostModel.flat(2e-3)(16, 500, 10_000) == pytest.approx(2e-3)
    lin = CostModel.linear(per_token=1e-3, fixed=1e-2)
    assert lin(8, 4, 0) == pytest.approx(1e-2 + 32e-3)


def test_below_the_grid_a_cost_is_the_first_points_and_beyond_it_never_falls():
    """A steep cache axis (a 1,024-token plane measured under load) must not turn a 34-token cache
    into a free forward: the planner padded every round to width 128 at ~0 s on such a model."""
    noisy = CostModel.one_row((1, 64, 128), ((1e-2, 9e-2, 0.18), (2e-2, 0.95, 6.5)), cache=(64, 1024))
    assert noisy(1, 128, 34) == pytest.approx(0.18) and noisy(1, 1, 0) == pytest.approx(1e-2)
    assert noisy(1, 200, 64) >= noisy(1, 128, 64)
    falling = CostModel.one_row((1, 2), ((2e-2, 1e-2),))
    assert falling(1, 4, 0) == pytest.approx(1e-2)  # the last point, not a line towards zero


def test_a_measured_model_round_trips_through_its_file_and_extrapolates_what_it_did_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "TOKEN_CAP", 8)
    m = tiny_model()
    prof = measure(m, rows=(1, 4), widths=(1, 2, 4, 8), cache=(16,), sweeps=1, budget_s=0.5, progress=False)
    assert prof.rows == (1, 4) and prof.weights == "fp32" and prof.cache == (16,)
    line = prof.seconds[0][1]  # rows 4: widths 4 and 8 (16 and 32 tokens) were not run
    assert line[3] >= line[1] and all(s > 0 for s in line)
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = CostModel.load(str(path), want=dict(device=prof.device, model=prof.model, dtype=prof.dtype))
    assert back.seconds == prof.seconds and json.loads(path.read_text())["format"] == FORMAT


@pytest.mark.parametrize("content, match", [
    (None, "not found"),
    ("{not json", "cannot be read"),
    (json.dumps({"format": "other"}), "format"),
    (json.dumps({"format": FORMAT, "device": "d", "model": "m", "dtype": "float32"}), "missing or malformed"),
    (json.dumps({"format": FORMAT, "device": "d", "model": "m", "dtype": "float32", "weights": "fp32", "rows": [1],
                 "widths": [4, 1], "cache": [0], "seconds": [[[1, 2]]]}), "not a valid cost model"),
    (json.dumps({"format": FORMAT, "device": "d", "model": "m", "dtype": "float32", "weights": "fp32", "rows": [1],
                 "widths": [1, 2], "cache": [0], "seconds": [[[1, float("nan")]]]}), "not a valid cost model"),
])
def test_a_bad_cost_model_file_is_one_clear_error_naming_it(tmp_path, content, match):
    path = tmp_path / "prof.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        CostModel.load(str(path))
    assert str(path) in str(e.value)


def test_the_older_one_row_and_batch_profile_files_are_read_as_they_are(tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps({"format": "selfspec-profile/1", "device": "synthetic", "model": "*", "dtype": "any",
                               "q": [1, 16], "c": [0, 1024], "seconds": [[1.0, 2.0], [1.5, 3.0]]}))
    p = CostModel.load(str(one))
    assert p.rows == (1,) and p(1, 16, 1024) == pytest.approx(3.0) and p(1, 1, 512) == pytest.approx(1.25)
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"format": "selfspec-batch-profile/1", "device": "synthetic", "model": "*",
                                 "dtype": "float32", "c": 256, "b": [1, 8], "q": [1, 4],
                                 "seconds": [[1.0, 2.0], [3.0, 6.0]]}))
    b = CostModel.load(str(batch))
    assert b.cache == (256,) and b.weights == "fp32" and b(8, 4, 0) == pytest.approx(6.0)


def test_a_cost_model_for_another_device_is_refused_when_given_but_remeasured_when_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "WIDTHS", (1, 2))
    monkeypatch.setattr(cost, "CACHE", (8,))
    m = tiny_model()
    other = CostModel("cpu: elsewhere", model_key(m), "float32", "fp32", (1,), (1, 2), (0,), (((1.0, 2.0),),))
    path = tmp_path / "given.json"
    other.save(str(path))
    with pytest.raises(ValueError, match="measured for device"):
        cost_model(m, str(path))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    cached = default_path(m)
    os.makedirs(os.path.dirname(cached))
    other.save(cached)  # a stale automatic one: measured again, not an error
    prof = cost_model(m, progress=False)
    assert prof.device == device_key(m.get_input_embeddings().weight.device)
    assert CostModel.load(cached).device == prof.device  # and the cache now holds the new one


def test_the_rows_axis_is_measured_as_far_as_a_run_needs_and_kept_in_one_file(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "WIDTHS", (1, 2))
    monkeypatch.setattr(cost, "CACHE", (8,))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    m = tiny_model()
    assert cost_model(m, progress=False).rows == (1,)
    assert cost_model(m, rows=3, progress=False).rows == (1, 2, 4)
    m.__dict__.pop("_selfspec_cost")
    assert CostModel.load(default_path(m)).rows == (1, 2, 4) == cost_model(m, rows=4, progress=False).rows


def test_building_a_decoder_measures_nothing_and_starting_it_measures_once(tmp_path, monkeypatch):
    """Measuring is a step of its own: a plan "auto" decoder built with no cost model cached
    measures nothing; it measures this device's when it starts (rows for its batch), and a
    second decoder reuses that one."""
    from selfspec.engine.schedule.decoder import Decoder
    from selfspec.engine.request.options import DecodeConfig

    monkeypatch.setattr(cost, "WIDTHS", (1, 2))
    monkeypatch.setattr(cost, "CACHE", (8,))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    calls, real = [], cost.measure
    monkeypatch.setattr(cost, "measure", lambda *a, **k: calls.append(k["rows"]) or real(*a, **k))
    m = tiny_model()
    cfg = DecodeConfig(max_new_tokens=2, block_length=4, budget=4)
    dec = Decoder(m, [[5, 6, 7], [8, 9]], cfg, eos_token_id=[])
    assert calls == [] and dec.stepper.planner is None and not os.path.exists(default_path(m))
    dec.start()
    assert calls == [(1, 2)] and dec.planner is not None
    for _ in Decoder(m, [[5, 6, 7], [8, 9]], cfg, eos_token_id=[]):
        pass
    assert calls == [(1, 2)]


class _Hangover:
    """A fake device: a forward of width w takes w ms, plus a 5 ms hangover for each of the next
    three forwards after one at least 8 wider (a CPU's state after a wide forward, as measured)."""

    def __init__(self):
        self.now, self.left, self.last, self.order = 0.0, 0, None, []

    def clock(self):
        return self.now

    def run(self, point):
        w = point[-1]
        if self.last is not None and self.last - w >= 8:
            self.left = 3
        self.now += w / 1e3 + (5e-3 if self.left else 0.0)
        self.left, self.last = max(0, self.left - 1), w
        self.order.append(w)


def test_each_point_is_timed_in_its_steady_state_not_after_the_shape_before_it():
    dev = _Hangover()
    points = [(0, 1, w) for w in (128, 64, 16, 4, 1)]
    best = cost.best_of_sweeps(points, dev.run, sweeps=2, budget_s=10.0, desc="", progress=False, clock=dev.clock)
    assert best == pytest.approx([w / 1e3 for *_, w in points])


def test_the_grid_is_swept_widest_first_within_each_cache_length(monkeypatch):
    seen = []
    monkeypatch.setattr(cost, "best_of_sweeps", lambda points, run, **k: seen.extend(points) or [1e-3] * len(points))
    measure(tiny_model(), rows=(1,), widths=(1, 2, 4, 8), cache=(4, 16), progress=False)
    assert [(c, w) for c, _, w in seen] == [(4, 8), (4, 4), (4, 2), (4, 1), (16, 8), (16, 4), (16, 2), (16, 1)]


def test_threads_that_start_at_once_measure_once(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "WIDTHS", (1, 2))
    monkeypatch.setattr(cost, "CACHE", (8,))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    calls, real = [], cost.measure
    monkeypatch.setattr(cost, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    m = tiny_model()
    got = []
    threads = [threading.Thread(target=lambda: got.append(cost_model(m, progress=False))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and all(g is got[0] for g in got)


def test_an_unwritable_cache_folder_leaves_the_model_in_memory_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(cost, "WIDTHS", (1, 2))
    monkeypatch.setattr(cost, "CACHE", (8,))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SELFSPEC_CACHE", str(blocker / "sub"))
    m = tiny_model()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        prof = cost_model(m, progress=False)
    assert prof.seconds and len([x for x in w if "could not be cached" in str(x.message)]) == 1
    assert cost_model(m) is prof  # reused in memory, no second measurement or warning


def test_two_cpus_of_one_name_but_different_vector_units_get_different_cost_models(monkeypatch):
    """"AMD EPYC" names CPUs with and without native bf16: their timings and their width invariance
    differ, so a cached cost model or format choice of one must not be read on the other."""
    import io

    from selfspec.engine.measure import device_id

    def cpuinfo(flags):
        text = f"processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 {flags}\n"
        return lambda *a, **k: io.StringIO(text)

    keys = []
    try:
        for flags in ("avx2", "avx2 avx512f avx512_bf16", "avx2 avx512f avx512_bf16"):
            monkeypatch.setattr(device_id, "open", cpuinfo(flags), raising=False)
            device_id._cpu_name.cache_clear()  # read once per process: here once per CPU
            keys.append(device_key(torch.device("cpu")))
    finally:
        device_id._cpu_name.cache_clear()
    assert keys[0] != keys[1] == keys[2]
    assert "AMD EPYC" in keys[0] and "avx512_bf16" in keys[1]


def test_a_changed_kernel_source_is_measured_again_not_judged_by_its_predecessors_times(tmp_path, monkeypatch):
    """The cost model and the weight-format choice are cached per machine; a kernel whose source
    changed (a new vector path, or a dispatch threshold in its Python) must get new files, and
    SELFSPEC_NO_KERNELS (the torch twins) others."""
    import shutil

    from selfspec.engine.measure import formats
    from selfspec.kernels import build

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    m = tiny_model()
    before = (default_path(m), formats._cache_path(m))
    src = tmp_path / "kernels"
    shutil.copytree(build.HERE, src, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(build, "HERE", str(src))
    assert (default_path(m), formats._cache_path(m)) == before  # the same sources: the same files
    with open(src / "w4a8.c", "a") as f:
        f.write("\n/* a changed kernel */\n")
    changed = (default_path(m), formats._cache_path(m))
    assert changed[0] != before[0] and changed[1] != before[1]
    with open(src / "attn16.py", "a") as f:
        f.write("\n# a moved threshold\n")
    assert default_path(m) not in (before[0], changed[0])
    changed = (default_path(m), formats._cache_path(m))
    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    assert default_path(m) not in (before[0], changed[0])


def _clocks(*readings):
    """A fake `cost.cpu_clocks`: (wall, machine busy, own CPU) seconds, one reading per call."""
    it = iter(readings)
    return lambda: next(it)


def test_a_cost_model_measured_beside_other_work_is_used_but_not_cached(tmp_path, monkeypatch):
    """Other processes busy on this process's cores while it measured (here 1.5 cores of 2 for the
    2 s it took): one warning naming them, the model used for this process, no file written, and
    the next process (a model without the memo) measures again."""
    monkeypatch.setattr(cost, "WIDTHS", (1, 2))
    monkeypatch.setattr(cost, "CACHE", (8,))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    calls, real = [], cost.measure
    monkeypatch.setattr(cost, "measure", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(cost, "cpu_clocks", _clocks((10.0, 50.0, 7.0), (12.0, 55.0, 9.0)))
    m = tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prof = cost_model(m, progress=False)
    assert [str(w.message)[:52] for w in caught] == ["other processes kept 1.5 of this machine's 2 cores b"]
    assert not os.path.exists(default_path(m)) and cost_model(m, progress=False) is prof and calls == [1]
    monkeypatch.setattr(cost, "cpu_clocks", _clocks((0.0, 0.0, 0.0), (2.0, 2.1, 2.0)))  # quiet: 0.05 cores
    m.__dict__.pop("_selfspec_cost")
    cost_model(m, progress=False)
    assert calls == [1, 1] and CostModel.load(default_path(m)).rows == (1,)


def test_only_other_processes_on_this_process_s_cores_count_as_busy(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    start = (0.0, 0.0, 0.0)
    assert cost.busy_elsewhere(start, (2.0, 8.0, 4.0)) is None  # 2 cores of others: the 2 spare ones
    assert cost.busy_elsewhere(start, (2.0, 9.0, 4.0)) == pytest.approx(2.5)  # half a core more: ours too
    assert cost.busy_elsewhere(start, (0.5, 9.0, 1.0)) is None  # under MIN_WINDOW_S: too few ticks to tell
    assert cost.busy_elsewhere(None, (2.0, 9.0, 4.0)) is None  # no /proc/stat here
    if os.path.exists("/proc/stat"):
        a = cost.cpu_clocks()
        b = cost.cpu_clocks()
        assert len(a) == 3 and b[0] >= a[0] and b[1] >= a[1] and b[2] >= a[2]


def test_a_weight_format_choice_timed_beside_other_work_is_not_cached(tmp_path, monkeypatch, capsys):
    """`weights="auto"`'s timing (`formats.choose`) follows the cost model's rule: beside other
    work the choice serves this process only, with one line; timed quietly, it is cached."""
    from selfspec.engine.measure import formats

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    report = {f: {"seconds": 1.0 / (i + 1), "invariant": f != "fp32", "agreement": 1.0, "kl": 0.0}
              for i, f in enumerate(formats.FORMATS)}
    monkeypatch.setattr(formats, "measure", lambda *a, **k: report)
    m = tiny_model()
    monkeypatch.setattr(cost, "cpu_clocks", _clocks((0.0, 0.0, 0.0), (2.0, 9.0, 1.0)))  # others: 4 cores
    assert formats.choose(m, torch.tensor([[1, 2]]), progress=False) == "w4a8"
    assert "while the weight formats were timed" in capsys.readouterr().err
    assert not os.path.exists(formats._cache_path(m))
    monkeypatch.setattr(cost, "cpu_clocks", _clocks((0.0, 0.0, 0.0), (2.0, 2.0, 2.0)))
    assert formats.choose(m, torch.tensor([[1, 2]]), progress=False) == "w4a8"
    assert capsys.readouterr().err == "" and os.path.exists(formats._cache_path(m))


def test_a_gpu_cost_model_is_cached_whatever_the_cpu_was_doing(tmp_path, monkeypatch):
    """A GPU's forward times are the GPU's: other processes on the CPU do not keep its cost model
    out of the cache (a shared GPU server's CPU is seldom idle)."""
    monkeypatch.setattr(cost, "WIDTHS", (1, 2))
    monkeypatch.setattr(cost, "CACHE", (8,))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    real = cost.identity
    monkeypatch.setattr(cost, "identity", lambda *a, **k: {**real(*a, **k), "device": "cuda: a test GPU"})
    monkeypatch.setattr(cost, "cpu_clocks", _clocks((10.0, 50.0, 7.0), (12.0, 55.0, 9.0)))  # as busy as above
    m = tiny_model()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cost_model(m, progress=False)
    assert caught == [] and CostModel.load(default_path(m)).device == "cuda: a test GPU"
