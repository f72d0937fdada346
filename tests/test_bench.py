import json
import os
import sys

import pytest

from selfspec.kernels import build as kernels_build
from selfspec.tools.bench import prompt_kind
from selfspec.tools.bench_prompts import read_prompts
from selfspec.tools.cli import main

from matrix import FORMATS


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "def add(a, b):\n"}) + "\n" + json.dumps({"id": "two", "prompt": "class A:\n"}) + "\n")
    return p


def test_bench_on_a_tiny_model_writes_consistent_results(tiny_dir, prompts, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--full", "--model", str(tiny_dir), "--prompts", str(prompts), "--budgets", "2", "6",
               "--max-new-tokens", "10", "--block-length", "4", "--out", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out.strip().splitlines()
    assert stdout[0].startswith("| mode | schedule | budget | T | tau")
    floor = [line for line in stdout if line.startswith("auto / AR at T = ")]
    assert len(floor) == 2 and all("worst prompt" in line for line in floor)  # the floor, per temperature
    summary = json.loads(stdout[-1])
    res = json.loads((out / "results.json").read_text())
    assert summary["n_prompts"] == res["n_prompts"] == 2
    assert {"torch", "transformers"} <= set(res["versions"])
    assert res["kernels"] == kernels_build.state()  # which C kernels ran
    rows = {(r["label"], r["temperature"]): r for r in res["rows"]}
    labels = {"ar", "auto", "linear/two-pass", "linear/one-pass", "presto/two-pass/N=2", "presto/two-pass/N=6",
              "presto/one-pass/N=2", "presto/one-pass/N=6", "hf-generate", "hf-generate/lookup=10", "lookup",
              "hybrid/two-pass/N=2", "hybrid/two-pass/N=6", "hybrid/one-pass/N=2", "hybrid/one-pass/N=6",
              "presto/auto/N=2", "presto/auto/N=6", "hybrid/auto/N=2", "hybrid/auto/N=6"}
    assert set(rows) == {(lab, t) for lab in labels for t in (0.0, 1.0)}  # default: greedy and sampled
    for t in (0.0, 1.0):
        ar_tps = rows["ar", t]["tokens_per_second"]
        for (lab, temp), r in rows.items():
            if temp != t:
                continue
            recs = r["records"]
            assert len(recs) == 2
            if t == 0:
                assert r["matches_ar"] == 2  # greedy: every mode and both peers equal selfspec AR
            tps = sum(x["new_tokens"] for x in recs) / sum(x["seconds"] for x in recs)
            assert r["tokens_per_second"] == pytest.approx(tps)
            assert r["speedup_vs_ar"] == pytest.approx(tps / ar_tps)
            assert set(r["by_kind"]) == {"line", "two"}  # ids "line1" (no id given) and "two": per kind too
            for k, v in r["by_kind"].items():
                mine, ar = ([x for x in rr if prompt_kind(x["id"]) == k] for rr in (recs, rows["ar", t]["records"]))
                kind_tps = sum(x["new_tokens"] for x in mine) / sum(x["seconds"] for x in mine)
                ar_kind = sum(x["new_tokens"] for x in ar) / sum(x["seconds"] for x in ar)
                assert v["tokens_per_second"] == pytest.approx(kind_tps)
                assert v["speedup_vs_ar"] == pytest.approx(kind_tps / ar_kind)
            if lab != "ar":  # the prompt where the row did worst against AR, named
                ratios = {x["id"]: x["new_tokens"] / x["seconds"] / (y["new_tokens"] / y["seconds"])
                          for x, y in zip(recs, rows["ar", t]["records"])}
                worst = min(ratios, key=ratios.get)
                w = r["worst_vs_ar"]
                assert (w["id"], w["speedup_vs_ar"]) == (worst, pytest.approx(ratios[worst]))
                rec = next(x for x in recs if x["id"] == worst)
                if not lab.startswith("hf"):  # how many of its rounds ran AR: a loss with no bet placed
                    assert (w["ar_rounds"], w["rounds"]) == (rec["plan_hist"].get("ar", 0), rec["rounds"])
                assert r["speedup_vs_ar_repeats"] is None  # one run a prompt: no spread to show
            if lab.startswith("hf"):
                assert r["tau"] is None  # peers report tokens/s only
                continue
            rounds, fwd = sum(x["rounds"] for x in recs), sum(x["forwards"] for x in recs)
            committed = sum(sum(x["accept_lengths"]) for x in recs)
            assert r["tau"] == pytest.approx(committed / rounds) and r["tpf"] == pytest.approx(committed / fwd)
            lengths = [a for x in recs for a in x["accept_lengths"]]
            assert r["accept_by_depth"][:2] == pytest.approx([sum(a >= 2 for a in lengths) / len(lengths),
                                                              sum(a >= 3 for a in lengths) / len(lengths)])
            if r["schedule"] == "two-pass":  # a draft pass per round, except where one token is left
                assert rounds < fwd <= 2 * rounds
            elif lab != "auto":  # AR and one-pass: one forward per round
                assert fwd == rounds
            if lab == "auto":
                assert sum(r["plan_hist"].values()) == rounds
    assert rows["ar", 0.0]["tau"] == 1.0 and rows["ar", 0.0]["accept_hist"] == {"1": rows["ar", 0.0]["new_tokens"] - 2}
    lin = rows["linear/one-pass", 0.0]["tokens_per_second"]
    n6 = rows["presto/one-pass/N=6", 0.0]
    assert n6["speedup_vs_linear"] == pytest.approx(n6["tokens_per_second"] / lin)
    pytest.importorskip("matplotlib")
    for name in ("tau_tps_vs_budget.png", "acceptance_hist.png"):
        assert os.path.getsize(out / name) > 1000


def test_malformed_prompt_lines_are_reported_with_line_numbers(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "ok"}\nnot json\n{"prompt": ""}\n{"messages": "x"}\n')
    with pytest.raises(ValueError) as e:
        read_prompts(str(p))
    msg = str(e.value)
    assert "line 2" in msg and "line 3" in msg and "line 4" in msg and "line 1" not in msg


def test_chat_prompts_are_accepted_by_the_reader(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert read_prompts(str(p))[0]["prompt"][0]["content"] == "hi"


@pytest.mark.parametrize("extra, match", [
    (["--modes", "ar", "beam"], "unknown mode"),
    (["--schedules", "zero-pass"], "unknown schedule"),
    (["--prompts", "/nonexistent.jsonl"], "not found"),
    (["--batch-sizes", "0"], "integers >= 1"),
    (["--batch-sizes", "2", "--modes", "hybrid"], "unknown mode 'hybrid' for batches"),
    (["--batch-sizes", "2", "--peers", "hf-lookup"], "unknown peer 'hf-lookup' for batches"),
    (["--control", "--modes", "auto"], "--control runs the AR row a second time"),
])
def test_bench_bad_input_fails_before_model_work(extra, match, prompts, tmp_path, capsys):
    args = ["bench", "--model", "/nonexistent/model", "--prompts", str(prompts), "--out", str(tmp_path / "o")]
    assert main(args + extra) == 2
    assert match in capsys.readouterr().err


def test_unwritable_output_folder_is_a_clear_error(prompts, tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["bench", "--model", "/nonexistent/model", "--prompts", str(prompts), "--out", str(blocker / "sub")]) == 2
    assert "cannot be written" in capsys.readouterr().err


def test_the_default_bench_is_the_short_grid_and_full_is_every_mode(tiny_dir, prompts, tmp_path, capsys):
    assert main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--peers", "--temperatures", "0", "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert {r["label"] for r in res["rows"]} == {"ar", "auto", "lookup"}


def test_the_default_bench_runs_transformers_only_beside_its_own_fp32_weights(tiny_dir, prompts, tmp_path):
    def labels(*args):
        out = tmp_path / str(len(args))
        assert main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "4",
                     "--temperatures", "0", "--modes", "ar", "--out", str(out), *args]) == 0
        return {r["label"] for r in json.loads((out / "results.json").read_text())["rows"]}

    assert labels("--weights", "fp32") == {"ar", "hf-generate"}
    assert labels("--weights", "int8", "--compare-weights", "fp32") == {"ar", "ar [fp32]"}


def test_the_llama_cpp_peer_without_its_package_is_one_clear_error(tiny_dir, prompts, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # absent even where it is installed
    rc = main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--peers", "llama.cpp",
               "--gguf", str(prompts), "--out", str(tmp_path / "o")])
    assert rc == 2 and "llama-cpp-python" in capsys.readouterr().err


def test_a_peer_that_fails_on_a_prompt_loses_that_prompt_not_the_run(tiny_dir, prompts, tmp_path, capsys,
                                                                     monkeypatch):
    """llama-cpp-python's prompt lookup raises past ~1k tokens: the bench goes on, the peer's row
    leaves the prompt out and says so, every other row keeps it."""

    class FlakyPeer:
        def __init__(self, gguf, prompt_lookup=0):
            self.first_token_seconds = None

        def label(self):
            return "llama.cpp"

        def run(self, ids, *, max_new_tokens, **kw):
            if len(ids) > 3:  # the warmup and the first prompt pass; the second prompt is longer
                raise ValueError("could not broadcast input array")
            self.first_token_seconds = 0.01
            return [7] * max_new_tokens, 0.02

    monkeypatch.setattr("selfspec.tools.bench.llama_cpp_available", lambda: True)
    monkeypatch.setattr("selfspec.tools.bench.llama_cpp_crash", lambda *a, **k: None)
    monkeypatch.setattr("selfspec.tools.peers.LlamaCppPeer", FlakyPeer)
    long_prompts = tmp_path / "q.jsonl"
    long_prompts.write_text(json.dumps({"id": "a", "prompt": "x"}) + "\n" +
                            json.dumps({"id": "b", "prompt": "def add(a, b): return a + b"}) + "\n")
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_dir), "--prompts", str(long_prompts), "--modes", "ar", "--peers",
               "llama.cpp", "--gguf", str(prompts), "--compare-weights", "--temperatures", "0",
               "--max-new-tokens", "4", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0
    assert "llama.cpp failed on b (ValueError: could not broadcast input array)" in captured.err
    rows = {r["label"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    peer = rows["llama.cpp"]
    assert peer["prompts"] == 1 and peer["failed"] == 1 and peer["new_tokens"] == 4
    assert [x.get("failed") for x in peer["records"]] == [None, "ValueError: could not broadcast input array"]
    assert rows["ar"]["prompts"] == 2 and rows["ar"]["failed"] == 0
    assert "(1 failed)" in (out / "table.md").read_text()


def _fake_llama_cpp(tmp_path, monkeypatch, body: str):
    """A `llama_cpp` package whose Llama() runs `body`, first on the path of every child process."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import os, signal, sys\n\nclass Llama:\n    def __init__(self, **kw):\n"
                                     f"        {body}\n\n    def generate(self, ids, **kw):\n        yield from ids\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setattr("selfspec.tools.bench.llama_cpp_available", lambda: True)


def test_a_llama_cpp_that_crashes_is_found_in_a_child_process_with_its_signal(tmp_path, monkeypatch):
    from selfspec.tools.peers import llama_cpp_crash

    _fake_llama_cpp(tmp_path, monkeypatch, "os.kill(os.getpid(), signal.SIGSEGV)")
    assert "crashed (SIGSEGV)" in llama_cpp_crash(str(tmp_path / "m.gguf"))


def test_a_llama_cpp_that_runs_passes_and_one_that_raises_says_why(tmp_path, monkeypatch):
    from selfspec.tools.peers import llama_cpp_crash

    _fake_llama_cpp(tmp_path, monkeypatch, "pass")
    assert llama_cpp_crash(str(tmp_path / "m.gguf")) is None
    _fake_llama_cpp(tmp_path / "b", monkeypatch, "raise ValueError('Failed to load model from file')")
    why = llama_cpp_crash(str(tmp_path / "m.gguf"))
    assert "exit 1" in why and "Failed to load model from file" in why


def test_a_crashing_llama_cpp_leaves_the_default_bench_without_its_rows(tiny_dir, prompts, tmp_path, capsys,
                                                                         monkeypatch):
    """llama-cpp-python 0.3.36 built on a CPU with AMX dies with SIGSEGV in its own kernels: run in
    the bench's process, it took the whole run down before a row was written."""
    _fake_llama_cpp(tmp_path, monkeypatch, "os.kill(os.getpid(), signal.SIGSEGV)")
    out = tmp_path / "out"
    assert main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "4",
                 "--temperatures", "0", "--modes", "ar", "--weights", "fp32", "--gguf", str(prompts),
                 "--out", str(out)]) == 0
    assert "llama.cpp rows skipped: llama-cpp-python crashed (SIGSEGV)" in capsys.readouterr().err
    assert {r["label"] for r in json.loads((out / "results.json").read_text())["rows"]} == {"ar", "hf-generate"}


def test_a_crashing_llama_cpp_asked_for_by_name_is_one_clear_error_before_any_work(tiny_dir, prompts, tmp_path,
                                                                                   capsys, monkeypatch):
    _fake_llama_cpp(tmp_path, monkeypatch, "os.kill(os.getpid(), signal.SIGSEGV)")
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--peers", "llama.cpp",
               "--gguf", str(prompts), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "the llama.cpp peer cannot run here: llama-cpp-python crashed (SIGSEGV)" in err
    assert not out.exists()


def test_bench_batch_sizes_rows_per_mode_and_b_with_every_row_checked_against_ar(tiny_dir, tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}(x):\n" * (1 + i % 3)}) + "\n"
                         for i in range(5)))
    assert main(["bench", "--model", str(tiny_dir), "--prompts", str(p), "--max-new-tokens", "6",
                 "--batch-sizes", "1", "3", "--modes", "auto", "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["kernels"] == kernels_build.state()
    got = {(r["mode"], r["batch_size"]): r for r in res["rows"]}
    assert set(got) == {(m, b) for m in ("ar", "auto", "hf") for b in (1, 3)}
    for r in res["rows"]:
        assert r["rows"] == 5 and r["rows_equal_ar"] == 5 and r["temperature"] == 0.0
        assert r["tokens_per_second"] > 0 and r["speedup_vs_batched_ar"] is not None
    assert got[("ar", 3)]["plan_hist"] == {"ar": sum(len(o) for o in got[("ar", 3)]["token_ids"]) - 5}
    out = capsys.readouterr().out
    assert "x batched AR" in out
    floor = [line for line in out.splitlines() if line.startswith("auto / batched AR at B = ")]
    assert [line.split(":")[0] for line in floor] == ["auto / batched AR at B = 1, T = 0", "auto / batched AR at B = 3, T = 0"]
    for line, b in zip(floor, (1, 3)):  # each line carries that batch size's ratio from the results
        assert f": {got[('auto', b)]['speedup_vs_batched_ar']:.2f}x, per run " in line
    assert floor[0] in (tmp_path / "o" / "table.md").read_text()


def _fake_batch_runs(monkeypatch, batch_sizes, **kw):
    """run_batch_bench over a fake run that returns 3 tokens a prompt and the next integer as its
    seconds: (the (B, mode) calls in order, the rows by (mode, B))."""
    from types import SimpleNamespace

    from selfspec.tools import bench_batch

    calls, clock = [], iter(range(1, 100))

    def fake_run(model, prompts_ids, mode, B, t, *rest):
        calls.append((B, mode))
        return [[1, 2, 3]] * len(prompts_ids), float(next(clock)), {}

    monkeypatch.setattr(bench_batch, "_batch_run", fake_run)
    model = SimpleNamespace(config=SimpleNamespace(mask_token_id=0, pad_token_id=0, eos_token_id=None))
    monkeypatch.setattr("selfspec.engine.schedule.decoder.Decoder", lambda *a, **k: [])
    rows = bench_batch.run_batch_bench(model, [[5, 6]] * 2, ["a", "b"], batch_sizes, ["ar", "auto"], max_new_tokens=3,
                                       temperatures=[0.0], peers=(), progress=False, **kw)
    return calls, {(r["mode"], r["batch_size"]): r for r in rows}


def test_the_batch_bench_runs_every_mode_twice_in_mirrored_order_and_times_both(monkeypatch):
    """A B C C B A per batch size: a machine that drifts during the block moves every mode alike."""
    calls, by = _fake_batch_runs(monkeypatch, [1, 4])
    order = ["ar", "auto", "auto", "ar"]
    assert calls == [(1, m) for m in order] + [(4, m) for m in order]
    assert by[("ar", 1)]["seconds"] == 1 + 4 and by[("auto", 1)]["seconds"] == 2 + 3
    assert by[("auto", 1)]["tokens_per_second"] == 12 / 5


def test_the_batch_bench_repeats_its_mirrored_block_and_sums_every_run(monkeypatch):
    """--repeats N: A B B A, N times over, per batch size; a row's time and tokens are all its runs'."""
    calls, by = _fake_batch_runs(monkeypatch, [4], repeats=3)
    assert calls == [(4, m) for m in ["ar", "auto", "auto", "ar"] * 3] + [(1, "ar")]  # then the greedy reference
    assert by[("ar", 4)]["seconds"] == 1 + 4 + 5 + 8 + 9 + 12 and by[("ar", 4)]["runs"] == 6
    assert by[("auto", 4)]["tokens_per_second"] == 6 * 6 / (2 + 3 + 6 + 7 + 10 + 11)


def test_a_batch_grid_without_batch_size_1_still_checks_every_greedy_row_against_batch_1_ar(monkeypatch):
    """--batch-sizes 4 8 once checked nothing (the reference was the timed B = 1 AR row's outputs): now one
    untimed batch-1 AR decode is the reference. Here it differs from every batched row on the second prompt."""
    from types import SimpleNamespace

    from selfspec.tools import bench_batch

    calls = []

    def fake_run(model, prompts_ids, mode, B, t, *rest):
        calls.append((B, mode, t))
        return ([[1, 2, 3], [1, 2, 4]] if B == 1 else [[1, 2, 3]] * len(prompts_ids)), 1.0, {}

    monkeypatch.setattr(bench_batch, "_batch_run", fake_run)
    monkeypatch.setattr("selfspec.engine.schedule.decoder.Decoder", lambda *a, **k: [])
    model = SimpleNamespace(config=SimpleNamespace(mask_token_id=0, pad_token_id=0, eos_token_id=None))
    rows = bench_batch.run_batch_bench(model, [[5, 6]] * 2, ["a", "b"], [8, 4], ["ar", "auto"], max_new_tokens=3,
                                       temperatures=[0.0, 1.0], peers=(), progress=False)
    assert calls[-1] == (1, "ar", 0.0) and sum(c[0] == 1 for c in calls) == 1
    assert [(r["batch_size"], r["temperature"], r["rows_equal_ar"]) for r in rows] == [
        (8, 0.0, 1), (8, 0.0, 1), (4, 0.0, 1), (4, 0.0, 1), (8, 1.0, None), (8, 1.0, None), (4, 1.0, None),
        (4, 1.0, None)]


def test_the_batch_floor_line_shows_auto_over_ar_run_by_run(monkeypatch):
    """Runs ar 1 s, auto 2 s, auto 3 s, ar 4 s (6 tokens each): pairs 0.5x and 1.33x, summed 1.0x."""
    from selfspec.tools.bench_batch import batch_floor_lines

    _, by = _fake_batch_runs(monkeypatch, [4])
    assert by[("auto", 4)]["speedup_vs_batched_ar_runs"] == pytest.approx([1 / 2, 4 / 3])
    assert by[("ar", 4)]["speedup_vs_batched_ar_runs"] is None
    assert batch_floor_lines(list(by.values())) == ["auto / batched AR at B = 4, T = 0: 1.00x, per run 0.50-1.33x"]


def test_the_batch_control_runs_ar_again_in_the_mirrored_block_with_its_own_floor_line(monkeypatch):
    """--control: A B C C B A with C the second AR. AR's runs take 1 s and 6 s, auto's 2 and 5, the
    control's 3 and 4: both 1.00x summed, run by run 0.50x / 1.20x and 0.33x / 1.50x; its line under auto's."""
    from selfspec.tools.bench_batch import batch_floor_lines

    calls, by = _fake_batch_runs(monkeypatch, [4], control=True)
    assert calls == [(4, m) for m in ["ar", "auto", "ar (control)", "ar (control)", "auto", "ar"]] + [(1, "ar")]
    assert by[("ar (control)", 4)]["seconds"] == 3 + 4 and by[("ar (control)", 4)]["label"] == "ar (control) B=4"
    assert batch_floor_lines(list(by.values())) == [
        "auto / batched AR at B = 4, T = 0: 1.00x, per run 0.50-1.20x",
        "control AR / batched AR at B = 4, T = 0: 1.00x, per run 0.33-1.50x"]


def test_the_batch_bench_runs_a_few_untimed_tokens_of_ours_after_each_transformers_run(monkeypatch):
    """The run after transformers' fp32 weights starts cold (ours 0.94x after an fp32 run): an untimed
    AR decode of ours takes that start, not the next timed row."""
    from types import SimpleNamespace

    from selfspec.tools import bench_batch

    events, clock = [], iter(range(1, 100))

    def fake_run(model, prompts_ids, mode, B, t, *rest):
        events.append(("timed", mode))
        return [[1, 2, 3]] * len(prompts_ids), float(next(clock)), {}

    def fake_decoder(model, prompts, cfg, **kw):
        events.append(("untimed", cfg.mode))
        return []

    monkeypatch.setattr(bench_batch, "_batch_run", fake_run)
    monkeypatch.setattr("selfspec.tools.peers.causal_lm", lambda model: None)
    monkeypatch.setattr("selfspec.engine.schedule.decoder.Decoder", fake_decoder)
    model = SimpleNamespace(config=SimpleNamespace(mask_token_id=0, pad_token_id=0, eos_token_id=None))
    bench_batch.run_batch_bench(model, [[5, 6]] * 2, ["a", "b"], [2], ["ar", "auto"], max_new_tokens=3,
                                temperatures=[0.0], peers=("hf",), progress=False)
    # (the last: batch-1 AR, the greedy rows' reference, when the grid has no batch size 1)
    assert [e[1] for e in events if e[0] == "timed"] == ["ar", "auto", "hf", "hf", "auto", "ar", "ar"]
    after_hf = [events[i + 1] for i, e in enumerate(events) if e == ("timed", "hf")]
    assert after_hf == [("untimed", "ar")] * 2


def test_the_control_row_runs_ar_again_equal_to_it_with_its_line_under_auto_s(tiny_dir, prompts, tmp_path,
                                                                            capsys):
    out = tmp_path / "o"
    assert main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--max-new-tokens", "6", "--peers",
                 "--control", "--repeats", "2", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out.splitlines()
    floor = [line for line in stdout if " / AR at T = " in line]
    assert [line.split(":")[0] for line in floor] == ["auto / AR at T = 0", "control AR / AR at T = 0",
                                                      "auto / AR at T = 1", "control AR / AR at T = 1"]
    assert all("per repeat" in line for line in floor)
    res = json.loads((out / "results.json").read_text())
    rows = {(r["label"], r["temperature"]): r for r in res["rows"]}
    for t in (0.0, 1.0):
        control, ar = rows["ar (control)", t], rows["ar", t]
        assert [x["token_ids"] for x in control["records"]] == [x["token_ids"] for x in ar["records"]]
        assert control["speedup_vs_ar"] == pytest.approx(control["tokens_per_second"] / ar["tokens_per_second"])
    assert rows["ar (control)", 0.0]["matches_ar"] == 2
    assert floor[1] in (out / "table.md").read_text()


def test_a_run_on_other_weights_is_followed_by_an_untimed_run_of_the_default_model(tiny_dir, prompts, tmp_path,
                                                                                     monkeypatch):
    """After the fp32 baseline's run the next run of ours went 0.94x (its weights push ours out of the
    cache); in the mirrored order that run is always the same row, so a few untimed AR tokens of the
    default model take the cold start instead."""
    from selfspec.engine.schedule import decoder as decoder_mod
    from selfspec.engine.forward.forward import FastForward

    events, Real = [], decoder_mod.Decoder

    class Spy(Real):
        def __init__(self, model, prompts, cfg, **kw):
            events.append((FastForward.of(model).weights, cfg.mode, cfg.max_new_tokens))
            super().__init__(model, prompts, cfg, **kw)

    monkeypatch.setattr(decoder_mod, "Decoder", Spy)
    assert main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--weights", "int8", "--modes", "ar",
                 "auto", "--compare-weights", "fp32", "--temperatures", "0", "--max-new-tokens", "6", "--repeats", "2",
                 "--out", str(tmp_path / "o")]) == 0
    timed = [i for i, e in enumerate(events) if e[2] == 6]
    assert [events[i][0] for i in timed] == ["int8", "int8", "fp32", "fp32", "int8", "int8"] * 2  # two prompts
    after = [events[i + 1] for i in timed if events[i][0] == "fp32"]
    assert after == [("int8", "ar", 8)] * 4


def test_repeats_run_every_row_again_in_mirrored_order_and_sum_the_runs(tiny_dir, prompts, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--modes", "ar", "auto", "--peers",
               "--compare-weights", "--temperatures", "0", "--max-new-tokens", "8", "--repeats", "2", "--out", str(out)])
    assert rc == 0
    rows = {r["label"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    for r in rows.values():
        for x in r["records"]:
            assert x["repeats"] == 2 and x["repeats_agree"]  # greedy: the same tokens both times
            assert x["new_tokens"] == 2 * len(x["token_ids"]) and sum(x["plan_hist"].values()) == x["rounds"]
    assert rows["auto"]["matches_ar"] == 2
    assert len(rows["auto"]["speedup_vs_ar_repeats"]) == 2  # auto over AR in each repeat, the floor line's spread
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("auto / AR")][0].count(
        "per repeat") == 1
    assert main(["bench", "--model", str(tiny_dir), "--repeats", "0"]) == 2


def test_a_peer_s_run_is_followed_by_an_untimed_run_of_ours_before_the_next_timed_row(tiny_dir, prompts, tmp_path,
                                                                                       monkeypatch):
    """The first run of ours after llama.cpp ran 2-4.5% slower (cold caches); in the mirrored order
    that run is always the same row, so a few untimed AR tokens take the cold start instead."""
    from selfspec.engine.schedule import decoder as decoder_mod
    from selfspec.tools import peers

    events, Real, real_run = [], decoder_mod.Decoder, peers.HFPeer.run

    class Spy(Real):
        def __init__(self, model, prompts, cfg, **kw):
            events.append(("ours", cfg.mode, cfg.max_new_tokens))
            super().__init__(model, prompts, cfg, **kw)

    def peer_run(self, *a, **kw):
        events.append(("peer",))
        return real_run(self, *a, **kw)

    monkeypatch.setattr(decoder_mod, "Decoder", Spy)
    monkeypatch.setattr(peers.HFPeer, "run", peer_run)
    assert main(["bench", "--model", str(tiny_dir), "--prompts", str(prompts), "--modes", "ar", "auto", "--peers",
                 "hf", "--temperatures", "0", "--max-new-tokens", "6", "--repeats", "2", "--out", str(tmp_path / "o")]) == 0
    timed = events[events.index(("peer",)) + 1:]  # after the warm-up's first peer run
    after = [timed[i + 1] for i, e in enumerate(timed) if e == ("peer",) and i + 1 < len(timed)]
    assert after and all(e == ("ours", "ar", 8) for e in after)


@pytest.mark.parametrize("weights", FORMATS)
def test_the_control_row_and_the_batch_reference_hold_in_every_weight_format(weights, tiny_dir, tmp_path):
    """--control's row and `auto`'s equal AR's tokens, and a batch grid without B = 1 checks every greedy row
    against batch-1 AR, whatever weights the bench runs."""
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"def f{i}(x):\n" * (1 + i % 3)}) + "\n"
                         for i in range(4)))
    common = ["bench", "--model", str(tiny_dir), "--prompts", str(p), "--weights", weights, "--max-new-tokens", "6",
              "--peers", "--control"]
    assert main(common + ["--compare-weights", "--temperatures", "0", "--out", str(tmp_path / "a")]) == 0
    rows = {r["label"]: r for r in json.loads((tmp_path / "a" / "results.json").read_text())["rows"]}
    assert rows["ar (control)"]["matches_ar"] == rows["auto"]["matches_ar"] == 4
    assert main(common + ["--batch-sizes", "3", "--out", str(tmp_path / "b")]) == 0
    rows = json.loads((tmp_path / "b" / "results.json").read_text())["rows"]
    assert [(r["mode"], r["rows_equal_ar"]) for r in rows] == [("ar", 4), ("auto", 4), ("ar (control)", 4)]
