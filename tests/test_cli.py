import json
import os

import pytest
import torch

from selfspec.tools.cli import main


def test_generate_json_record_has_the_documented_fields(tiny_dir, capsys):
    rc = main(["generate", "--model", str(tiny_dir), "--prompt", "def f(x):\n", "--max-new-tokens", "12",
               "--mode", "presto", "--block-length", "4", "--budget", "6", "--json"])
    assert rc == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("text", "token_ids", "new_tokens", "rounds", "forwards", "tau", "tpf", "seconds",
                "tokens_per_second", "mode", "schedule", "budget", "rho", "lam", "oracle_tau", "kernels"):
        assert key in rec, key
    assert rec["new_tokens"] == len(rec["token_ids"]) <= 12


def test_generate_streams_text_and_matches_ar(tiny_dir, capsys):
    outs = []
    for mode in ("ar", "linear"):
        assert main(["generate", "--model", str(tiny_dir), "--prompt", "import os", "--max-new-tokens", "10",
                     "--mode", mode, "--schedule", "two-pass", "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1]
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "import os", "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert "tau" in captured.err


def test_generate_with_the_one_byte_cache_matches_its_ar(tiny_dir, capsys, monkeypatch):
    """--kv-cache-dtype int8 reaches the cache (a spy on the decoder's cache), and lookup's greedy
    output with it equals AR's with it."""
    from selfspec.engine.forward.batch_forward import BatchForward

    made = []
    new_cache = BatchForward.new_cache
    monkeypatch.setattr(BatchForward, "new_cache",
                        lambda self, *a, **k: made.append(new_cache(self, *a, **k)) or made[-1])
    outs = []
    for mode in ("ar", "lookup"):
        assert main(["generate", "--model", str(tiny_dir), "--prompt", "import os", "--max-new-tokens", "10",
                     "--weights", "int4", "--kv-cache-dtype", "int8", "--mode", mode, "--json"]) == 0
        outs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
        assert made[-1].k[0].dtype == torch.int8 and made[-1].shifts[0].dtype == torch.int32  # the generation's
    assert outs[0] == outs[1]


@pytest.mark.parametrize("args, match", [
    (["--block-length", "1"], "block_length"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--budget", "0"], "budget"),
])
def test_bad_options_fail_before_the_model_is_loaded(args, match, capsys):
    rc = main(["generate", "--model", "/nonexistent/model", "--prompt", "x", *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert match in err and "nonexistent" not in err


def test_missing_model_directory_is_a_clear_error(capsys):
    assert main(["generate", "--model", "/nonexistent/model", "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_info_says_what_a_bug_report_needs_and_measures_nothing(tiny_dir, capsys, monkeypatch, tmp_path):
    """Versions, CPU, each kernel's state, caches; the weight format "auto" picks only where it was
    measured before (a report written here stands in for a measurement, labelled simulated)."""
    import selfspec
    from selfspec.checkpoint.model import load
    from selfspec.engine.measure import formats
    from selfspec.kernels import build

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.delenv("SELFSPEC_WEIGHTS", raising=False)
    assert main(["info", "--model", str(tiny_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["versions"]["selfspec"] == selfspec.__version__ and info["versions"]["torch"] == torch.__version__
    assert set(info["kernels"]) == set(build.names()) and info["kernels"] == build.state()
    assert info["weights"]["chosen"] is None and "not measured yet" in info["weights"]["note"]
    assert info["caches"]["kernels"] == build.kernel_dir() and not os.path.exists(tmp_path / "profiles")
    model, _ = load(str(tiny_dir), dtype=torch.float32, draft_lora=False)
    simulated = {"invariant": True, "agreement": 1.0, "kl": 0.0}  # simulated report: int4 the faster
    os.makedirs(os.path.dirname(formats._cache_path(model)))
    with open(formats._cache_path(model), "w") as f:
        json.dump({"formats": {"int4": {**simulated, "seconds": 1.0}, "w4a8": {**simulated, "seconds": 2.0}}}, f)
    assert main(["info", "--model", str(tiny_dir)]) == 0
    text = capsys.readouterr().out
    assert "-> int4" in text and "KV cache: int16" in text
    for name in build.names():
        assert f"  {name} " in text
