import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import selfspec.checkpoint.model as model_module
import reference_cache as kv
from selfspec.checkpoint import versions
from transformers import Ministral3Model

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_declares_exactly_the_tested_transformers_range():
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"transformers{versions.TRANSFORMERS_RANGE}"' in text


def test_compat_script_tests_the_two_ends_of_the_range():
    script = (ROOT / "benchmarks/compat.sh").read_text()
    oldest = re.search(r"^OLDEST=(\S+)", script, re.M).group(1)
    newest = re.search(r"^NEWEST=(\S+)", script, re.M).group(1)
    assert oldest == versions.TRANSFORMERS_MIN
    assert versions.in_range(newest)
    # nothing released between NEWEST and the bound: the bound is the next minor release
    assert versions.parse(newest)[:2] == (versions.parse(versions.TRANSFORMERS_BELOW)[0],
                                          versions.parse(versions.TRANSFORMERS_BELOW)[1] - 1)


@pytest.mark.parametrize("v, ok", [("5.4.0", True), ("5.19.0", True), ("5.24.0", True), ("5.24.1.dev0", True),
                                   ("5.3.0", False), ("5.0.0", False), ("4.57.6", False),
                                   ("5.25.0", False), ("5.40.0", False), ("6.0.0", False)])
def test_transformers_outside_the_tested_range_is_refused_naming_the_range(v, ok, monkeypatch):
    monkeypatch.delenv(versions.OVERRIDE_ENV, raising=False)
    if ok:
        versions.check_transformers(v)
    else:
        with pytest.raises(ImportError, match=re.escape(versions.TRANSFORMERS_RANGE)):
            versions.check_transformers(v)


def test_the_override_turns_the_refusal_into_a_warning(monkeypatch):
    monkeypatch.setenv(versions.OVERRIDE_ENV, "1")
    with pytest.warns(UserWarning, match=re.escape(versions.TRANSFORMERS_RANGE)):
        versions.check_transformers("5.3.0")


def test_import_selfspec_checks_the_installed_transformers():
    code = ("import transformers; transformers.__version__ = '5.3.0'\n"
            "try:\n    import selfspec\nexcept ImportError as e:\n    print('refused:', e)\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != versions.OVERRIDE_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert "refused:" in out.stdout and versions.TRANSFORMERS_RANGE in out.stdout, out.stdout + out.stderr


def test_cache_argument_is_read_from_the_forward_signature():
    def new(self, input_ids=None, cache=None, past_key_values=None, **kw): ...
    def old(self, input_ids=None, past_key_values=None, **kw): ...
    def neither(self, input_ids=None, **kw): ...
    assert versions.cache_argument(new) == "cache"
    assert versions.cache_argument(old) == "past_key_values"
    with pytest.raises(ImportError, match="neither"):
        versions.cache_argument(neither)


def test_the_installed_backbone_takes_the_detected_cache_argument():
    assert model_module.CACHE_ARG in __import__("inspect").signature(Ministral3Model.forward).parameters


def test_a_dropped_cache_is_a_clear_error_not_wrong_tokens(model, monkeypatch):
    # what an older transformers does with an argument name it does not know: swallow it
    monkeypatch.setattr(model_module, "CACHE_ARG", "not_the_cache_argument")
    cache = kv.new_cache(model)
    with pytest.raises(RuntimeError, match="did not grow by the query length"):
        model(torch.randint(5, 64, (1, 6)), cache=cache)


def test_a_used_cache_grows_by_the_query_length(model):
    cache = kv.new_cache(model)
    model(torch.randint(5, 64, (1, 6)), cache=cache)
    model(torch.randint(5, 64, (1, 3)), cache=cache)
    assert kv.length(cache) == 9
