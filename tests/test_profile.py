"""Cost profiles: measured on the device, cached per device/model/dtype, read back with checks."""

import json
import os
import warnings

import pytest

from selfspec.engine.profile import FORMAT, CostProfile, cost_model, default_path, device_key, measure, model_key

from conftest import tiny_model


def test_interpolation_between_and_beyond_grid_points():
    p = CostProfile("d", "m", "float32", (1, 9), (0, 100), ((1.0, 2.0), (2.0, 4.0)))
    assert p(5, 0) == pytest.approx(1.5) and p(1, 50) == pytest.approx(1.5)
    assert p(17, 0) == pytest.approx(3.0)  # extrapolated from the last two points
    assert CostProfile.flat(2e-3)(500, 10_000) == pytest.approx(2e-3)


def test_a_measured_profile_grows_with_query_tokens_and_round_trips_through_its_file(tmp_path):
    m = tiny_model()
    prof = measure(m, grid_q=[1, 8, 64], grid_c=[16], sweeps=2, progress=False)
    assert list(prof.seconds[0]) == sorted(prof.seconds[0])  # non-decreasing in q
    path = tmp_path / "p.json"
    prof.save(str(path))
    back = CostProfile.load(str(path), device=prof.device, model=prof.model, dtype=prof.dtype)
    assert back.seconds == prof.seconds and json.loads(path.read_text())["format"] == FORMAT


@pytest.mark.parametrize("content, match", [
    (None, "not found"),
    ("{not json", "cannot be read"),
    (json.dumps({"format": "other"}), "format"),
    (json.dumps({"format": FORMAT, "device": "d", "model": "m", "dtype": "float32"}), "missing or malformed"),
    (json.dumps({"format": FORMAT, "device": "d", "model": "m", "dtype": "float32", "q": [4, 1], "c": [0],
                 "seconds": [[1, 2]]}), "not a valid cost profile"),
    (json.dumps({"format": FORMAT, "device": "d", "model": "m", "dtype": "float32", "q": [1, 2], "c": [0],
                 "seconds": [[1, float("nan")]]}), "not a valid cost profile"),
])
def test_a_bad_profile_file_is_one_clear_error_naming_it(tmp_path, content, match):
    path = tmp_path / "prof.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
        CostProfile.load(str(path))
    assert str(path) in str(e.value)


def test_a_profile_for_another_model_or_device_is_refused_when_given_but_remeasured_when_cached(tmp_path, monkeypatch):
    m = tiny_model()
    other = CostProfile("cpu: elsewhere", model_key(m), "float32", (1, 2), (0,), ((1.0, 2.0),))
    path = tmp_path / "given.json"
    other.save(str(path))
    with pytest.raises(ValueError, match="measured for device"):
        cost_model(m, str(path))
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    cached = default_path(m)
    os.makedirs(os.path.dirname(cached))
    other.save(cached)  # a stale automatic profile: measured again, not an error
    prof = cost_model(m)
    assert prof.device == device_key(m.get_input_embeddings().weight.device)
    assert CostProfile.load(cached).device == prof.device  # and the cache now holds the new one


def test_an_unwritable_cache_folder_leaves_the_profile_in_memory_with_one_warning(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("SELFSPEC_CACHE", str(blocker / "sub"))
    m = tiny_model()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        prof = cost_model(m)
    assert prof.seconds and len([x for x in w if "could not be cached" in str(x.message)]) == 1
    assert cost_model(m) is prof  # reused in memory, no second measurement or warning
