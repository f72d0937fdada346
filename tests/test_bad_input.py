"""Every bad input is one clear error before model work: the CLI prints one line on stderr and
exits 2 (never a traceback); the Python API raises ValueError / FileNotFoundError naming the
option or the file. One table for the CLI, one for the API, so that no case regresses."""

import json
import os
import shutil

import pytest
import torch

import selfspec
from selfspec.tools.cli import main
from selfspec.engine.request.options import DecodeConfig
from selfspec.checkpoint.model import NemotronLabsDiffusionModel

NO_MODEL = "/nonexistent/model"


def _corrupt(kind: str, fp: str) -> None:
    data = open(fp, "rb").read()
    n = int.from_bytes(data[:8], "little")
    if kind == "data_cut":  # header intact, the last tensors' bytes missing
        data = data[: 8 + n + (len(data) - 8 - n) // 2]
    elif kind == "header_cut":
        data = data[: 8 + n // 2]
    elif kind == "garbage":
        data = torch.randint(0, 256, (len(data),), generator=torch.Generator().manual_seed(0),
                             dtype=torch.uint8).numpy().tobytes()
    elif kind == "empty":
        data = b""
    elif kind == "bad_offsets":  # a declared tensor reaches past the data: padding bytes appended
        data = data + b"\0" * 16
    open(fp, "wb").write(data)


def _edit_config(path, **changes):
    cfg = os.path.join(path, "config.json")
    raw = json.load(open(cfg))
    raw.update(changes)
    json.dump(raw, open(cfg, "w"))


def _drop_tensor(path):
    from safetensors.torch import load_file, save_file

    fp = os.path.join(path, "model.safetensors")
    t = load_file(fp)
    del t["encoder.norm.weight"]
    save_file(t, fp)


CKPT_CASES = {
    # name: (how to break a copy of a good checkpoint, what the message says)
    "truncated data": (lambda p: _corrupt("data_cut", os.path.join(p, "model.safetensors")), "model.safetensors is corrupt or truncated"),
    "truncated header": (lambda p: _corrupt("header_cut", os.path.join(p, "model.safetensors")), "model.safetensors is corrupt or truncated"),
    "garbage weights": (lambda p: _corrupt("garbage", os.path.join(p, "model.safetensors")), "model.safetensors is corrupt or truncated"),
    "empty weights": (lambda p: _corrupt("empty", os.path.join(p, "model.safetensors")), "model.safetensors is corrupt or truncated"),
    "trailing bytes": (lambda p: _corrupt("bad_offsets", os.path.join(p, "model.safetensors")), "model.safetensors is corrupt or truncated"),
    "no config.json": (lambda p: os.remove(os.path.join(p, "config.json")), "has no config.json"),
    "config not JSON": (lambda p: open(os.path.join(p, "config.json"), "w").write("{oops"), "config.json is not valid JSON"),
    "wrong model_type": (lambda p: _edit_config(p, model_type="llama"), "model_type is 'llama'"),
    "mask id outside vocab": (lambda p: _edit_config(p, mask_token_id=10**6), "mask_token_id 1000000 is outside"),
    "tensor missing": (_drop_tensor, "'encoder.norm.weight' is missing"),
}


@pytest.fixture(scope="module")
def broken(tiny_dir, tmp_path_factory):
    """name -> a copy of the tiny checkpoint broken as CKPT_CASES says."""
    root = tmp_path_factory.mktemp("broken")
    out = {}
    for name, (breaker, _) in CKPT_CASES.items():
        path = str(root / name.replace(" ", "_"))
        shutil.copytree(tiny_dir, path)
        breaker(path)
        out[name] = path
    return out


@pytest.fixture
def no_model_work(monkeypatch):
    """Fails the test if the weights would be loaded (the check must come first)."""
    def refuse(*a, **k):
        raise AssertionError("model loading started")

    monkeypatch.setattr(NemotronLabsDiffusionModel, "from_pretrained", refuse)


def _cli(args, capsys):
    try:
        rc = main(args)
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _assert_one_line_error(rc, err, match):
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "Traceback" not in err
    assert match in err, err


def _files(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "adir").mkdir()
    return tmp_path


NO_GPU = not torch.cuda.is_available()
HAS_MPS = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()

# (extra args after `generate --prompt x --model /nonexistent/model`, expected message part):
# each is refused before the model directory is even looked at.
GENERATE_OPTIONS = [
    (["--block-length", "1"], "block_length must be >= 2"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--temperature", "nan"], "temperature must be a finite number, got nan"),
    (["--temperature", "inf"], "temperature must be a finite number, got inf"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "nan"], "top_p must be a finite number"),
    (["--lam", "nan"], "lam must be a finite number, got nan"),
    (["--lam", "inf"], "lam must be a finite number, got inf"),
    (["--lam", "-1"], "lam (PRESTO lambda) must be >= 0"),
    (["--budget", "0"], "budget must be >= 1"),
    (["--tree-top-k", "0"], "tree_top_k (tree candidates per depth) must be >= 1"),
    (["--top-k", "-1"], "top_k must be >= 0"),
    (["--group-size", "0"], "group_size must be >= 1"),
    (["--group-nodes", "0"], "group_nodes must be >= 1"),
    (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["--mode", "beam"], "argument --mode: invalid choice: 'beam'"),
    (["--budget", "many"], "argument --budget: invalid int value: 'many'"),
    (["--sample-top-k", "3"], "unrecognized arguments: --sample-top-k"),
    (["--prompt", ""], "empty prompt"),
    (["--device", "cuda:99"], "device 'cuda:99' does not exist on this machine; available: cpu"),
    pytest.param(["--device", "cuda"], "device 'cuda' does not exist on this machine; available: cpu",
                 marks=pytest.mark.skipif(not NO_GPU, reason="this machine has CUDA")),
    pytest.param(["--device", "mps"], "device 'mps' does not exist on this machine; available: cpu",
                 marks=pytest.mark.skipif(HAS_MPS, reason="this machine has MPS")),
    (["--device", "warp9"], "unknown device 'warp9'"),
    (["--dtype", "int8"], "dtype torch.int8 is not a floating-point type"),
    (["--dtype", "float99"], "unknown dtype 'float99'"),
    (["--kv-cache-dtype", "fp8"], "argument --kv-cache-dtype: invalid choice: 'fp8'"),
    (["--weights", "fp32", "--kv-cache-dtype", "int8"], "kv_cache_dtype='int8' is a compact cache of the exact"),
]


@pytest.mark.parametrize("args, match", GENERATE_OPTIONS)
def test_bad_generate_option_is_one_line_exit_2_before_the_model(args, match, capsys):
    rc, out, err = _cli(["generate", "--model", NO_MODEL, "--prompt", "x", *args], capsys)
    _assert_one_line_error(rc, err, match)
    assert "nonexistent" not in err and out == ""


@pytest.mark.parametrize("name, match", [
    ("missing.txt", "missing.txt not found"),
    ("empty.txt", "empty prompt (prompt file"),
    ("latin1.txt", "latin1.txt is not UTF-8 text"),
    ("adir", "adir is a directory"),
])
def test_bad_prompt_file_is_one_line_exit_2_before_the_model(name, match, tmp_path, capsys):
    path = str(_files(tmp_path) / name)
    rc, _, err = _cli(["generate", "--model", NO_MODEL, "--prompt-file", path], capsys)
    _assert_one_line_error(rc, err, match)
    assert "nonexistent" not in err


@pytest.mark.parametrize("name", list(CKPT_CASES))
def test_broken_checkpoint_is_one_line_exit_2_naming_the_file(name, broken, no_model_work, capsys):
    rc, _, err = _cli(["generate", "--model", broken[name], "--prompt", "x"], capsys)
    _assert_one_line_error(rc, err, CKPT_CASES[name][1])
    assert broken[name] in err


def test_missing_model_directory_is_one_line_exit_2(capsys):
    rc, _, err = _cli(["generate", "--model", NO_MODEL, "--prompt", "x"], capsys)
    _assert_one_line_error(rc, err, "model directory /nonexistent/model does not exist")


@pytest.mark.parametrize("args, match", [
    (["--max-new-tokens", "250", "--mode", "presto"], "needs 259 positions; the model has max_position_embeddings=256"),
    (["--rho", "learned"], "rho 'learned' needs a trained predictor"),
    (["--stop", ""], "stop strings must be non-empty"),
])
def test_bad_request_on_a_loaded_model_is_one_line_exit_2(args, match, tiny_dir, capsys):
    rc, out, err = _cli(["generate", "--model", str(tiny_dir), "--prompt", "x", "--block-length", "8", *args], capsys)
    _assert_one_line_error(rc, err, match)
    assert out == ""


@pytest.mark.parametrize("args, match", [
    (["--modes", "ar", "beam"], "unknown mode 'beam'"),
    (["--schedules", "zero-pass"], "unknown schedule 'zero-pass'"),
    (["--prompts", "/nonexistent.jsonl"], "prompt file /nonexistent.jsonl not found"),
    (["--temperature", "nan"], "temperature must be a finite number"),
    (["--lam", "inf"], "lam must be a finite number"),
    (["--tree-top-k", "0"], "tree_top_k"),
    (["--device", "cuda:99"], "device 'cuda:99' does not exist"),
    (["--budgets", "0"], "budget must be >= 1"),
])
def test_bad_bench_option_is_one_line_exit_2_before_the_model(args, match, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    rc, _, err = _cli(["bench", "--model", NO_MODEL, "--prompts", str(prompts), "--out", str(tmp_path / "o"), *args], capsys)
    _assert_one_line_error(rc, err, match)


def test_bad_bench_prompt_lines_are_one_line_with_their_numbers(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "ok"}\nnot json\n{"prompt": ""}\n')
    rc, _, err = _cli(["bench", "--model", NO_MODEL, "--prompts", str(prompts), "--out", str(tmp_path / "o")], capsys)
    _assert_one_line_error(rc, err, "line 2: not JSON")
    assert "line 3" in err


def test_bench_on_a_truncated_checkpoint_is_one_line_exit_2(broken, no_model_work, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    rc, _, err = _cli(["bench", "--model", broken["truncated data"], "--prompts", str(prompts),
                       "--out", str(tmp_path / "o")], capsys)
    _assert_one_line_error(rc, err, "model.safetensors is corrupt or truncated")


# -- the same inputs through the Python API ----------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"),
    (dict(top_p=float("nan")), "top_p must be a finite number"),
    (dict(lam=float("nan")), "lam must be a finite number"),
    (dict(lam=float("inf")), "lam must be a finite number"),
    (dict(lam=float("-inf")), "lam must be a finite number"),
    (dict(tree_top_k=0), "tree_top_k"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(budget=0), "budget must be >= 1"),
])
def test_bad_decode_config_raises_value_error_naming_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        DecodeConfig(**kwargs)


@pytest.mark.parametrize("name", list(CKPT_CASES))
def test_load_of_a_broken_checkpoint_raises_naming_the_file(name, broken, no_model_work):
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        selfspec.load(broken[name])
    assert CKPT_CASES[name][1] in str(e.value) and broken[name] in str(e.value)


def test_from_pretrained_refuses_a_truncated_file_before_transformers_reads_it(broken):
    with pytest.raises(ValueError, match="corrupt or truncated"):
        NemotronLabsDiffusionModel.from_pretrained(broken["truncated data"])


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(device="cuda:99"), ValueError, "available: cpu"),
    (dict(device="warp9"), ValueError, "unknown device"),
    (dict(dtype="int8"), ValueError, "not a floating-point type"),
    (dict(path=NO_MODEL), FileNotFoundError, "does not exist"),
    (dict(kv_cache_dtype="fp8"), ValueError, "unknown kv_cache_dtype 'fp8'"),
    (dict(weights="fp32", kv_cache_dtype="int8"), ValueError, "fp32 keeps a float cache"),
    (dict(dtype="float32", kv_cache_dtype="int8"), ValueError, "fp32 keeps a float cache"),
])
def test_load_with_a_bad_argument_raises_before_model_work(kwargs, exc, match, tiny_dir, no_model_work):
    kwargs.setdefault("path", str(tiny_dir))
    with pytest.raises(exc, match=match):
        selfspec.load(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_k=-1), "top_k must be >= 0"),
    (dict(tree_top_k=0), "tree_top_k"),
    (dict(lam=float("inf")), "lam must be a finite number"),
])
def test_compat_presto_spec_generate_refuses_bad_options(kwargs, match):
    from conftest import tiny_model

    m = tiny_model()
    with pytest.raises(ValueError, match=match):
        m.presto_spec_generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, block_length=4, **kwargs)


# -- tokenizer files: missing or corrupt, for both kinds a checkpoint may carry ----------------

def _hf_tokenizer(path) -> None:
    """A transformers tokenizer (tokenizer.json + tokenizer_config.json), the default model's kind."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "x": 5, "def": 6}, unk_token="<unk>"))
    words.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>").save_pretrained(str(path))


TOKENIZER_KINDS = {"sentencepiece": "tokenizer.model", "transformers": "tokenizer.json"}


@pytest.fixture(scope="module")
def tokenizer_ckpts(tmp_path_factory):
    """(kind, damage) -> a copy of the shipped model whose tokenizer file is gone or cut short,
    and the file's path; the copies link the weights (only the tokenizer differs)."""
    from conftest import SHIPPED
    from selfspec.checkpoint.tokenizer import load_tokenizer

    root, out = tmp_path_factory.mktemp("tokenizers"), {}
    for kind, name in TOKENIZER_KINDS.items():
        for damage in ("intact", "missing", "corrupt"):
            path = root / f"{kind}-{damage}"
            shutil.copytree(SHIPPED, path, ignore=shutil.ignore_patterns("model.safetensors"))
            os.symlink(os.path.join(SHIPPED, "model.safetensors"), path / "model.safetensors")
            if kind == "transformers":
                os.remove(path / "tokenizer.model")
                _hf_tokenizer(path)
            fp = path / name
            if damage == "missing":
                os.remove(fp)
            elif damage == "corrupt":
                fp.write_bytes(fp.read_bytes()[:500])
            out[kind, damage] = str(path), str(fp)
    for kind in TOKENIZER_KINDS:  # the intact ones load: the damage alone makes the error
        assert load_tokenizer(out[kind, "intact"][0]).encode("def x")
    return out


TOKENIZER_CASES = [(k, d) for k in TOKENIZER_KINDS for d in ("missing", "corrupt")]
TOKENIZER_ERRORS = {"missing": (FileNotFoundError, "not found"), "corrupt": (ValueError, "is corrupt")}


@pytest.mark.parametrize("kind, damage", TOKENIZER_CASES)
def test_load_with_a_missing_or_corrupt_tokenizer_file_raises_naming_it(kind, damage, tokenizer_ckpts, no_model_work):
    path, fp = tokenizer_ckpts[kind, damage]
    exc, words = TOKENIZER_ERRORS[damage]
    with pytest.raises(exc) as e:
        selfspec.load(path)
    assert type(e.value) is exc and f"tokenizer file {fp} {words}" in str(e.value)


@pytest.mark.parametrize("kind, damage", TOKENIZER_CASES)
def test_a_missing_or_corrupt_tokenizer_file_is_one_line_exit_2_from_each_command(kind, damage, tokenizer_ckpts,
                                                                                 tmp_path):
    """The real command, in a process of its own: exactly one `error:` line naming the file, exit 2."""
    import subprocess
    import sys

    path, fp = tokenizer_ckpts[kind, damage]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x"}) + "\n")
    command = {("sentencepiece", "missing"): ["generate", "--prompt", "x"],
               ("sentencepiece", "corrupt"): ["bench", "--prompts", str(prompts), "--out", str(tmp_path / "o")],
               ("transformers", "missing"): ["serve", "--port", "0"],
               ("transformers", "corrupt"): ["chat"]}[kind, damage]
    r = subprocess.run([sys.executable, "-m", "selfspec", *command, "--model", path], input="hi\n",
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: "), r.stderr
    assert f"tokenizer file {fp} {TOKENIZER_ERRORS[damage][1]}" in r.stderr and r.stdout == ""
