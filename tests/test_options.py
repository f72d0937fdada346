"""Options are typed at the boundary: a value of the wrong type is one TypeError naming the option,
the type it needs and the value given, raised before any model work. A flag never takes a string
("off" is truthy), a count never takes a float or a bool, a real number never takes a string or
None. The same holds for the keywords of `stream` / `generate` that are not options, and for the
upstream entry points."""

from dataclasses import fields

import numpy as np
import pytest
import torch

from selfspec.engine.request.options import DecodeConfig
from selfspec.streaming import generate, stream

from conftest import tiny_model

# option -> (a value of the wrong type, the message it gives); every DecodeConfig field has a row
BAD_TYPES = [
    ("mode", 3, "mode must be a str or None, got 3 (int)"),
    ("mode", ["presto"], "mode must be a str or None, got ['presto'] (list)"),
    ("plan", True, "plan must be a str or None, got True (bool)"),
    ("schedule", 2, "schedule must be a str or None, got 2 (int)"),
    ("block_length", 8.0, "block_length must be an int, got 8.0 (float)"),
    ("block_length", "8", "block_length must be an int, got '8' (str)"),
    ("group_size", 4.5, "group_size must be an int or None, got 4.5 (float)"),
    ("group_size", True, "group_size must be an int or None, got True (bool)"),
    ("group_nodes", "all", "group_nodes must be an int or None, got 'all' (str)"),
    ("max_new_tokens", 3.5, "max_new_tokens must be an int, got 3.5 (float)"),
    ("max_new_tokens", True, "max_new_tokens must be an int, got True (bool)"),
    ("max_new_tokens", None, "max_new_tokens must be an int, got None (NoneType)"),
    ("temperature", "0.7", "temperature must be a real number, got '0.7' (str)"),
    ("temperature", False, "temperature must be a real number, got False (bool)"),
    ("top_k", 2.0, "top_k must be an int, got 2.0 (float)"),
    ("top_p", None, "top_p must be a real number, got None (NoneType)"),
    ("top_p", "0.9", "top_p must be a real number, got '0.9' (str)"),
    ("budget", "32", "budget must be an int, got '32' (str)"),
    ("budget", 32.0, "budget must be an int, got 32.0 (float)"),
    ("tree_top_k", 2.0, "tree_top_k must be an int, got 2.0 (float)"),
    ("lam", None, "lam must be a real number, got None (NoneType)"),
    ("lam", "0.2", "lam must be a real number, got '0.2' (str)"),
    ("rho", None, "rho must be a str, got None (NoneType)"),
    ("rho", 1, "rho must be a str, got 1 (int)"),
    ("sampling", True, "sampling must be a str, got True (bool)"),
    ("draft_lora", "no", "draft_lora must be a bool (True or False), got 'no' (str)"),
    ("draft_lora", 0, "draft_lora must be a bool (True or False), got 0 (int)"),
    ("lookup", "off", "lookup must be a bool (True or False) or None, got 'off' (str)"),
    ("lookup", 1, "lookup must be a bool (True or False) or None, got 1 (int)"),
    ("lookup_min_ngram", 1.0, "lookup_min_ngram must be an int, got 1.0 (float)"),
    ("lookup_max_ngram", "3", "lookup_max_ngram must be an int, got '3' (str)"),
    ("lookup_tokens", 10.5, "lookup_tokens must be an int, got 10.5 (float)"),
]


def test_every_option_has_a_wrong_type_case():
    assert {f.name for f in fields(DecodeConfig)} == {name for name, _, _ in BAD_TYPES}


@pytest.mark.parametrize("name, value, message", BAD_TYPES, ids=[f"{n}={v!r}" for n, v, _ in BAD_TYPES])
def test_a_decode_option_of_the_wrong_type_is_a_type_error_naming_it(name, value, message):
    with pytest.raises(TypeError) as e:
        DecodeConfig(**{name: value})
    assert str(e.value) == message


@pytest.mark.parametrize("name, value, message", BAD_TYPES, ids=[f"{n}={v!r}" for n, v, _ in BAD_TYPES])
def test_stream_keeps_the_type_error_of_a_decode_option(name, value, message):
    with pytest.raises(TypeError) as e:
        stream(tiny_model(), None, [5, 6, 7], **{name: value})
    assert str(e.value) == message


def test_values_of_the_right_kind_are_accepted_as_builtin_types():
    cfg = DecodeConfig(budget=np.int64(8), temperature=1, top_p=np.float32(0.5), lam=0, group_size=None,
                       lookup=False, draft_lora=False, mode=None, plan=None, group_nodes=None)
    assert type(cfg.budget) is int and cfg.budget == 8
    assert type(cfg.temperature) is float and cfg.temperature == 1.0
    assert type(cfg.top_p) is float and type(cfg.lam) is float
    assert cfg.lookup is False and cfg.draft_lora is False


def test_an_unknown_option_is_still_named_as_unknown():
    with pytest.raises(ValueError, match=r"unknown decoding option 'tree_topk' \(did you mean 'tree_top_k'\?\)"):
        stream(tiny_model(), None, [5, 6, 7], tree_topk=3)
    with pytest.raises(ValueError, match="unknown decoding option 'sample_top_k'"):
        generate(tiny_model(), None, [5, 6, 7], sample_top_k=3)


STREAM_BAD_TYPES = [
    ("seed", 1.5, "seed must be an int, a list of int or None, got 1.5 (float)"),
    ("seed", "0", "seed must be an int, a list of int or None, got '0' (str)"),
    ("stop", 3, "stop must be a str, a list of str or None, got 3 (int)"),
    ("stop", ["\n", 3], "stop must be a str, a list of str or None, got ['\\n', 3] (list)"),
    ("trace", "yes", "trace must be a bool (True or False), got 'yes' (str)"),
    ("trace", None, "trace must be a bool (True or False), got None (NoneType)"),
    ("eos_token_id", "2", "eos_token_id must be an int, a list of int or None, got '2' (str)"),
    ("eos_token_id", [2.0], "eos_token_id must be an int, a list of int or None, got [2.0] (list)"),
    ("generator", 0, "generator must be a Generator or None, got 0 (int)"),
]


@pytest.mark.parametrize("name, value, message", STREAM_BAD_TYPES, ids=[f"{n}={v!r}" for n, v, _ in STREAM_BAD_TYPES])
def test_a_stream_keyword_of_the_wrong_type_is_a_type_error_naming_it(name, value, message):
    for fn in (stream, generate):
        with pytest.raises(TypeError) as e:
            fn(tiny_model(), None, [5, 6, 7], max_new_tokens=2, **{name: value})
        assert str(e.value) == message


COMPAT_BAD_TYPES = [
    ("presto_spec_generate", "budget", "8", "budget must be an int, got '8' (str)"),
    ("presto_spec_generate", "lam", None, "lam must be a real number, got None (NoneType)"),
    ("ar_generate", "max_new_tokens", 4.0, "max_new_tokens must be an int, got 4.0 (float)"),
    ("ar_generate", "eos_token_id", "2", "eos_token_id must be an int, a list of int or None, got '2' (str)"),
    ("presto_spec_generate", "mask_token_id", "4", "mask_token_id must be an int or None, got '4' (str)"),
    ("linear_spec_generate", "threshold", "0", "threshold must be a real number, got '0' (str)"),
    ("linear_spec_generate", "generator", 0, "generator must be a Generator or None, got 0 (int)"),
]


@pytest.mark.parametrize("entry, name, value, message", COMPAT_BAD_TYPES,
                         ids=[f"{f}-{n}={v!r}" for f, n, v, _ in COMPAT_BAD_TYPES])
def test_an_upstream_entry_point_argument_of_the_wrong_type_is_a_type_error_naming_it(entry, name, value, message):
    m = tiny_model()
    with pytest.raises(TypeError) as e:
        getattr(m, entry)(torch.tensor([[5, 6, 7]]), **{"max_new_tokens": 4, name: value})
    assert str(e.value) == message


@pytest.mark.parametrize("prompt_ids", ["def f", torch.tensor([[0.5, 1.5]]), [[[5]]]])
def test_upstream_prompt_ids_that_are_not_token_ids_are_a_type_error(prompt_ids):
    with pytest.raises(TypeError, match="prompt_ids must be a LongTensor"):
        tiny_model().ar_generate(prompt_ids, max_new_tokens=2)
