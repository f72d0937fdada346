"""The bench family's subcommands: `bench compare` on synthetic results (labelled as such) and
`bench quality` end to end on the shipped 9M model."""

import json
import os

import pytest

from selfspec.tools.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NLD9M = os.path.join(ROOT, "models", "pystdlib-nld-9m")


def _results(path, rows):
    """A synthetic results.json: only the fields `bench compare` reads (not a measurement)."""
    path.write_text(json.dumps({"command": "synthetic", "rows": rows}))
    return str(path)


def _row(label, tps, t=0.0, mode=None):
    return {"label": label, "mode": mode or label, "temperature": t, "tokens_per_second": tps}


def test_compare_prints_each_ratio_the_control_spread_and_rows_of_one_file(tmp_path, capsys):
    a = _results(tmp_path / "a.json", [_row("ar", 100.0), _row("ar (control)", 95.0), _row("auto", 120.0),
                                       _row("lookup", 80.0)])
    b = _results(tmp_path / "b.json", [_row("ar", 110.0), _row("ar (control)", 112.2), _row("auto", 150.0),
                                       _row("presto/auto/N=8", 70.0)])
    assert main(["bench", "compare", a, b, "--json"]) == 0
    out = capsys.readouterr().out.splitlines()
    res = json.loads(out[-1])
    rows = {r["label"]: r for r in res["rows"]}
    assert rows["auto"]["ratio"] == pytest.approx(1.25) and rows["ar"]["ratio"] == pytest.approx(1.1)
    assert rows["auto"]["control_a"] == pytest.approx(0.95) and rows["auto"]["control_b"] == pytest.approx(1.02)
    assert rows["auto"]["spread"] == pytest.approx(0.05)  # the larger of the two runs' control spreads
    assert rows["auto"]["beyond_spread"] is True and rows["ar (control)"]["beyond_spread"] is True
    only = {(r["label"], r["only_in"]) for r in res["only"]}
    assert only == {("lookup", "A"), ("presto/auto/N=8", "B")}
    table = "\n".join(out)
    assert "| auto | 0.0 | 120.0 | 150.0 | 1.25x | 0.95 | 1.02 | yes |" in table
    assert "| lookup | 0.0 | only in A |" in table and "| presto/auto/N=8 | 0.0 | only in B |" in table


def test_compare_marks_a_ratio_inside_the_spread_as_noise_and_says_when_no_control_ran(tmp_path, capsys):
    a = _results(tmp_path / "a.json", [_row("ar", 100.0), _row("ar (control)", 90.0), _row("auto", 100.0)])
    b = _results(tmp_path / "b.json", [_row("ar", 100.0), _row("auto", 105.0)])
    main(["bench", "compare", a, b, "--json"])
    rows = {r["label"]: r for r in json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]}
    assert rows["auto"]["beyond_spread"] is False  # 5% inside A's 10%
    c = _results(tmp_path / "c.json", [_row("ar", 100.0), _row("auto", 100.0)])
    main(["bench", "compare", c, b])
    assert "no --control row" in capsys.readouterr().out


def test_compare_pairs_rows_by_temperature_and_batch_controls_by_batch_size(tmp_path, capsys):
    rows_a = [_row("ar", 10.0, 1.0), _row("ar B=4", 40.0, mode="ar"), _row("ar (control) B=4", 44.0, mode="ar (control)")]
    for r in rows_a[1:]:
        r["batch_size"] = 4
    a = _results(tmp_path / "a.json", rows_a)
    b = _results(tmp_path / "b.json", [_row("ar", 20.0, 1.0), {**rows_a[1], "tokens_per_second": 60.0}])
    main(["bench", "compare", a, b, "--json"])
    res = json.loads(capsys.readouterr().out.splitlines()[-1])
    rows = {(r["label"], r["temperature"]): r for r in res["rows"]}
    assert rows["ar", 1.0]["ratio"] == pytest.approx(2.0) and rows["ar", 1.0]["control_a"] is None
    assert rows["ar B=4", 0.0]["control_a"] == pytest.approx(1.1)
    assert {(r["label"], r["only_in"]) for r in res["only"]} == {("ar (control) B=4", "A")}


@pytest.mark.parametrize("text, match", [("{", "not a JSON file"), ('{"rows": 3}', "not a bench results.json")])
def test_compare_refuses_a_file_that_is_not_a_results_json_before_printing(text, match, tmp_path, capsys):
    good = _results(tmp_path / "a.json", [_row("ar", 1.0)])
    bad = tmp_path / "b.json"
    bad.write_text(text)
    assert main(["bench", "compare", good, str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and match in err
    assert main(["bench", "compare", good, str(tmp_path / "none.json")]) == 2
    assert "not found" in capsys.readouterr().err


def test_quality_end_to_end_on_the_9m_model(tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(["bench", "quality", "--model", NLD9M, "--limit", "1", "--tokens", "6", "--formats", "bf16", "int4",
               "--kv-cache", "--transformers", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["label"]: r for r in res["rows"]}
    assert set(rows) == {"bf16", "bf16 [kv int8]", "int4", "int4 [kv int8]", "transformers"}
    assert all(r["positions"] == 6 and 0 <= r["agreement"] <= 1 and r["kl"] >= -1e-6 for r in rows.values())
    assert rows["int4"]["kl"] > rows["bf16"]["kl"]  # 4-bit weights move the logits more than bf16's rounding
    assert rows["transformers"]["agreement"] == 1.0 and rows["transformers"]["max_abs_logit_diff"] < 1e-3
    assert res["n_prompts"] == 1 and res["command"].startswith("python -m selfspec bench quality")
    assert "| int4 [kv int8] | int8 | 6 |" in capsys.readouterr().out


def test_quality_refuses_fp32_and_unknown_formats_before_loading(tmp_path, capsys):
    for fmt in ("fp32", "int3"):
        assert main(["bench", "quality", "--formats", fmt, "--out", str(tmp_path / fmt)]) == 2
        assert "bench quality" in capsys.readouterr().err
        assert not (tmp_path / fmt).exists()


def test_serve_bench_end_to_end_on_the_9m_model(tmp_path, capsys):
    out = tmp_path / "s"
    rc = main(["bench", "serve", "--model", NLD9M, "--mode", "ar", "--limit", "1", "--max-new-tokens", "4",
               "--repeats", "1", "--clients", "2", "--max-batch", "3", "--join-tokens", "200", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    rows = {r["label"]: r for r in res["rows"]}
    both, join = "served x2 concurrent (stream)", "served x2 concurrent (stream) + a long prompt joining"
    assert list(rows) == ["in-process", "served", "served (stream)", both, join]
    assert [rows[k]["new_tokens"] for k in rows] == [4, 4, 4, 8, 8]  # every request decoded its tokens, none lost
    assert rows["in-process"]["vs_in_process"] == 1.0 and rows[both]["lost"] == rows[join]["lost"] == 0
    assert res["server_exit_code"] == 0 and rows[both]["ttft_p50_seconds"] > 0
    assert 0 < rows[both]["itl_p50_seconds"] <= rows[both]["itl_p95_seconds"]  # 3 gaps a stream of 4 tokens
    assert rows[join]["join_ttft_seconds"] > 0 and "join_ttft_seconds" not in rows[both]
    assert "| served (stream) | 4 |" in capsys.readouterr().out


def test_serve_bench_refuses_bad_counts_before_starting_anything(tmp_path, capsys):
    assert main(["bench", "serve", "--clients", "0", "--out", str(tmp_path / "x")]) == 2
    assert ">= 1" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["bench", "serve", "--join-tokens", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "--join-tokens" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_the_decode_grid_takes_a_thread_count_and_a_sampling_and_records_them(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    out = tmp_path / "t"
    try:
        rc = main(["bench", "--model", NLD9M, "--limit", "1", "--threads", "1", "--modes", "ar", "lookup",
                   "--temperature", "0", "--max-new-tokens", "8", "--peers", "--compare-weights", "--sampling",
                   "independent", "--out", str(out)])
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["machine"]["threads"] == 1 and res["n_prompts"] == 1
    assert [r["label"] for r in res["rows"]] == ["ar", "lookup"] and res["rows"][1]["matches_ar"] == 1
    assert {r["config"]["sampling"] for r in res["rows"]} == {"independent"}  # --sampling reaches every row
    assert main(["bench", "--threads", "0", "--out", str(tmp_path / "z")]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


def test_profile_measures_a_curve_of_its_own_and_prints_it(tmp_path, capsys):
    out = tmp_path / "curve.json"
    assert main(["profile", "--model", NLD9M, "--widths", "1", "4", "--cache", "16", "--table", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| cached | rows | w=1 | w=4 |" and lines[2].startswith("| 16 | 1 | ")
    assert "(1.00x)" in lines[2]  # f(1, 1, cache) over itself
    saved = json.loads(out.read_text())
    assert saved["widths"] == [1, 4] and saved["cache"] == [16]
    assert json.loads(lines[-1])["path"] == str(out)


def test_profile_measured_beside_other_work_says_so_and_still_writes(tmp_path, capsys, monkeypatch):
    from selfspec.engine.measure import cost

    readings = iter([(0.0, 0.0, 0.0), (2.0, 9.0, 1.0)])  # others: 4 cores for 2 s, more than any spare here
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(cost, "cpu_clocks", lambda: next(readings))
    out = tmp_path / "curve.json"
    assert main(["profile", "--model", NLD9M, "--widths", "1", "--cache", "16", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "other processes kept 4.0 of this machine's cores busy" in err and "again when" in err
    assert json.loads(out.read_text())["widths"] == [1]


def test_a_profile_curve_of_its_own_never_replaces_the_cached_cost_model(tmp_path, capsys):
    assert main(["profile", "--model", NLD9M, "--widths", "1", "4"]) == 2
    assert "--out" in capsys.readouterr().err


def test_compare_reads_tau_when_asked_and_claims_no_spread_for_it(tmp_path, capsys):
    a = _results(tmp_path / "a.json", [{**_row("linear/two-pass", 50.0), "tau": 1.2}, _row("ar (control)", 9.0),
                                       {**_row("ar", 10.0), "tau": 1.0}])
    b = _results(tmp_path / "b.json", [{**_row("linear/two-pass", 40.0), "tau": 2.4}, {**_row("ar", 10.0), "tau": 1.0}])
    main(["bench", "compare", a, b, "--metric", "tau", "--json"])
    out = capsys.readouterr().out
    rows = {r["label"]: r for r in json.loads(out.splitlines()[-1])["rows"]}
    assert rows["linear/two-pass"]["ratio"] == pytest.approx(2.0) and rows["linear/two-pass"]["beyond_spread"] is None
    assert "| row | T | A tau | B tau |" in out and "a spread of tok/s only" in out


def test_plot_writes_a_results_files_plots_again(tmp_path, capsys):
    pytest.importorskip("matplotlib")  # the plot extra: a missing external package
    run = tmp_path / "run"
    assert main(["bench", "--model", NLD9M, "--limit", "1", "--modes", "ar", "lookup", "--temperature", "0",
                 "--max-new-tokens", "8", "--peers", "--compare-weights", "--out", str(run)]) == 0
    for png in run.glob("*.png"):
        png.unlink()
    capsys.readouterr()
    assert main(["bench", "plot", str(run / "results.json")]) == 0
    written = capsys.readouterr().out.split()
    assert written and all(os.path.getsize(p) > 1000 and p.endswith(".png") for p in written)
    quality = tmp_path / "q.json"
    quality.write_text(json.dumps({"rows": [{"label": "int4", "agreement": 0.9}]}))  # synthetic: not a grid
    assert main(["bench", "plot", str(quality)]) == 2
    assert "not a decode-grid results.json" in capsys.readouterr().err


def test_profile_lora_cost_times_a_probe_round_with_and_without_the_adapter(tmp_path, capsys):
    import shutil

    from selfspec.loading import load
    from selfspec.training.draft_lora import DraftParams, export

    ckpt = tmp_path / "nld9m"
    shutil.copytree(NLD9M, ckpt)
    model, _ = load(str(ckpt), progress=False)
    export(DraftParams(model, r=4, alpha=8), model, str(ckpt / "linear_spec_lora"))  # an untrained adapter
    assert main(["profile", "--model", str(ckpt), "--lora-cost", "--widths", "1", "5", "--cache", "16",
                 "--repeats", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| width | cached | no LoRA ms |") and out[2].startswith("| 1 | 16 |")
    rows = json.loads(out[-1])["lora_cost"]
    assert [r["width"] for r in rows] == [1, 5] and all(r["ms"] > 0 and r["lora_ms"] > 0 for r in rows)
    assert main(["profile", "--model", NLD9M, "--lora-cost"]) == 2  # the shipped 9M model has no adapter
    assert "no draft LoRA" in capsys.readouterr().err
