"""benchmarks/gpu_check.py: its CPU dry run (synthetic:tiny) runs every part but the CUDA-only ones."""

import importlib.util
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_help_runs_nothing(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _script().main(["--help", "--out", str(tmp_path / "out")])
    assert e.value.code == 0 and "--dry-run" in capsys.readouterr().out and not (tmp_path / "out").exists()


def test_dry_run_at_a_tiny_shape(tmp_path):
    gc = _script()
    assert gc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["environment"]["dry_run"] and res["bandwidth"]["bytes_per_second"] > 0
    (rec,) = res["models"]
    assert rec["model"] == "synthetic:tiny" and "random" in rec["label"]
    assert list(rec["cost"]["f_ms"]) == [str(w) for w in gc.DRY_WIDTHS] and min(rec["cost"]["f_ms"].values()) > 0
    assert rec["cost"]["bandwidth_floor_ms"] > 0
    assert [p["layout"] for p in rec["projections"]][0] == "ar" and len(rec["projections"]) == 1 + 2 * len(gc.PUBLISHED_TAU)
    assert rec["graphs"] is None and any("CUDA only" in s for s in rec["skipped"])
    rows = rec["rows"]
    assert [r["row"].split()[0] for r in rows] == ["ar", "linear", "presto"]
    assert all(r["equal_to_ar"] and r["new_tokens"] == 8 and 0 <= r["overhead_share"] < 1 for r in rows)
    want = "replayed acceptance (profile nld-8b)" if gc.has_replay() else "random drafts (no replay in this checkout)"
    assert all(r["drafts"] == want for r in rows[1:])
    assert set(rec["targets"].values()) == {None}  # a dry run measures no GPU target
    assert "DRY RUN" in (tmp_path / "gpu_check.md").read_text()
