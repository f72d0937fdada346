"""Generation defaults from the model: a checkpoint's generation_config.json (read once, in
`checkpoint/generation.py`) sets the sampling of `selfspec chat` for the flags it is not given and
of the server for the fields a request leaves out; `generate` stays greedy unless asked. The
default model's conversion writes its card's recommendation (temperature 0.2, top-p 0.9), and a
conversion made before gets it added in place. Repetition settings, which the runtime does not
have, are reported, never silently dropped."""

import json
import logging
import os
import shutil

import pytest

import selfspec
from selfspec.checkpoint import registry
from selfspec.checkpoint.convert import SMOLLM2_GENERATION
from selfspec.checkpoint.generation import GenerationSettings, read_generation_config
from selfspec.tools import chat
from selfspec.tools.cli import main


def _write(folder, obj):
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(obj, f)


# -- the reader ------------------------------------------------------------------------------------
def test_the_reader_follows_transformers_meaning(tmp_path):
    assert read_generation_config(tmp_path) == GenerationSettings() and not GenerationSettings().sampled
    _write(tmp_path, {"temperature": 0.7, "top_p": 0.5})  # no do_sample: greedy, as in transformers
    g = read_generation_config(tmp_path)
    assert (g.temperature, g.top_p, g.source) == (0.0, 1.0, str(tmp_path / "generation_config.json"))
    _write(tmp_path, {"do_sample": True, "top_p": 0.9, "top_k": 40, "max_new_tokens": 64, "repetition_penalty": 1.1,
                      "no_repeat_ngram_size": 0})
    g = read_generation_config(tmp_path)
    assert (g.temperature, g.top_p, g.top_k, g.max_new_tokens) == (1.0, 0.9, 40, 64)  # transformers' temperature 1
    assert g.describe() == "temperature 1, top-p 0.9, top-k 40"
    assert g.unsupported == (("repetition_penalty", 1.1),)  # 0 n-gram size is off
    assert "repetition_penalty 1.1" in g.unsupported_note() and "not applied" in g.unsupported_note()
    _write(tmp_path, {"do_sample": True, "temperature": -1, "top_p": 7, "repetition_penalty": 1.0})
    g = read_generation_config(tmp_path)
    assert (g.temperature, g.top_p, g.unsupported) == (1.0, 1.0, ())  # unusable values keep their defaults
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="generation_config.json cannot be read"):
        read_generation_config(tmp_path)


# -- conversion ------------------------------------------------------------------------------------
def test_conversion_writes_the_sampling_it_is_given_and_carries_an_hf_sources(tmp_path):
    from test_convert import write_gguf

    from selfspec.checkpoint import convert as conv
    from selfspec.checkpoint.convert_sources import HFSource

    write_gguf(tmp_path / "tiny.gguf")
    out = conv.convert(tmp_path / "tiny.gguf", tmp_path / "nld", progress=False, generation=SMOLLM2_GENERATION)
    gen = json.loads((tmp_path / "nld" / "generation_config.json").read_text())
    assert {k: gen[k] for k in SMOLLM2_GENERATION} == {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
    assert gen["eos_token_id"] == 2 and gen["suppress_tokens"]  # the ids stay
    g = read_generation_config(out)
    assert (g.temperature, g.top_p, g.top_k) == (0.2, 0.9, 0)
    # an HF source's own sampling settings come along (its file, not a GGUF's metadata)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                 max_position_embeddings=64)).save_pretrained(hf)
    _write(hf, {"do_sample": True, "temperature": 0.6, "top_k": 20, "repetition_penalty": 1.2, "eos_token_id": 2})
    assert HFSource(str(hf)).generation == {"do_sample": True, "temperature": 0.6, "top_k": 20,
                                            "repetition_penalty": 1.2}


def test_the_default_model_gets_its_cards_sampling_converted_or_added_in_place(monkeypatch, tmp_path):
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(registry, "_TEMP", {})
    monkeypatch.setattr("selfspec.checkpoint.convert.smollm2_gguf", lambda: "SmolLM2.gguf")
    calls = []

    def fake_convert(src, out, *, generation=None, **kw):
        calls.append(generation)
        os.makedirs(out)
        open(os.path.join(out, "config.json"), "w").close()
        _write(out, {"eos_token_id": 2, **(generation or {})})

    monkeypatch.setattr("selfspec.checkpoint.convert.convert", fake_convert)
    path = registry.resolve("smollm2-135m-instruct", progress=False)
    assert calls == [SMOLLM2_GENERATION] and read_generation_config(path).describe() == "temperature 0.2, top-p 0.9"
    # a conversion made before the converter wrote them: added in place, not converted again
    _write(path, {"eos_token_id": 2, "suppress_tokens": [49152]})
    assert registry.resolve("smollm2-135m-instruct", progress=False) == path and len(calls) == 1
    gen = json.loads(open(os.path.join(path, "generation_config.json")).read())
    assert gen == {"eos_token_id": 2, "suppress_tokens": [49152], **SMOLLM2_GENERATION}
    # what the file says already is kept, and a current file is not rewritten
    _write(path, {"eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_p": 1.0})
    before = os.stat(os.path.join(path, "generation_config.json")).st_mtime_ns
    registry.resolve("smollm2-135m-instruct", progress=False)
    assert os.stat(os.path.join(path, "generation_config.json")).st_mtime_ns == before
    assert read_generation_config(path).temperature == 0.7


# -- chat, generate, the server --------------------------------------------------------------------
@pytest.fixture
def sampled_dir(tiny_dir, tmp_path):
    """The tiny checkpoint with a generation_config.json that samples (and a repetition penalty)."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, d)
    _write(d, {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "top_k": 5, "repetition_penalty": 1.3,
               "eos_token_id": 2})
    return str(d)


def _chat(monkeypatch, capsys, argv, rc=0):
    """`python -m selfspec chat ARGV`: the keyword arguments the conversation runs with, and stderr."""
    seen = {}
    monkeypatch.setattr(chat, "run_chat", lambda model, tok, **kw: seen.update(kw) or 0)
    assert main(["chat", *argv]) == rc
    return seen, capsys.readouterr().err


def test_chat_samples_as_the_checkpoint_says_and_a_flag_wins(sampled_dir, monkeypatch, capsys):
    kw, err = _chat(monkeypatch, capsys, ["--model", sampled_dir])
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.6, 0.8, 5)
    assert "temperature 0.6, top-p 0.8, top-k 5" in err and "repetition_penalty 1.3" in err
    assert "not applied" in err
    kw, err = _chat(monkeypatch, capsys, ["--model", sampled_dir, "--temperature", "0.9"])
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.9, 0.8, 5)  # the flag; the file's filters
    kw, _ = _chat(monkeypatch, capsys, ["--model", sampled_dir, "--temperature", "0", "--top-k", "0"])
    assert (kw["temperature"], kw["top_k"]) == (0.0, 0)  # greedy when asked
    _write(sampled_dir, {"eos_token_id": 2})  # a file that does not sample: greedy
    kw, err = _chat(monkeypatch, capsys, ["--model", sampled_dir])
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.0, 1.0, 0) and "greedy" in err
    kw, err = _chat(monkeypatch, capsys, ["--model", sampled_dir, "--top-p", "2"], rc=2)
    assert kw == {} and "top_p" in err  # a bad flag still fails before the conversation


def test_chat_help_says_where_sampling_comes_from(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "generation_config.json" in text and "greedy unless --temperature" in text
    assert "repetition_penalty" in text


def test_generate_stays_greedy_whatever_the_checkpoint_says(sampled_dir):
    model, tok = selfspec.load(sampled_dir)
    gen = selfspec.stream(model, tok, [5, 6, 7, 8, 9], max_new_tokens=8, eos_token_id=[], mode="ar")
    assert list(gen.decoder.params)[0].temperature == 0.0  # what its rows sample with: greedy
    assert len(selfspec.generate(model, tok, [5, 6, 7, 8, 9], max_new_tokens=8, eos_token_id=[], mode="ar",
                                 temperature=0.6, seed=1).token_ids) == 8  # and samples when asked


def test_the_server_takes_the_checkpoints_defaults_and_says_what_it_cannot_apply(sampled_dir, caplog):
    from selfspec.engine.request.options import DecodeConfig
    from selfspec.engine.request.sequence import SamplingParams
    from selfspec.serving.openai_api.defaults import model_defaults
    from selfspec.serving.openai_api.service import Service, ServiceOptions

    from conftest import tiny_model

    d = model_defaults(sampled_dir, max_tokens=7)
    assert d.params == SamplingParams(max_new_tokens=7, temperature=0.6, top_k=5, top_p=0.8)
    assert d.unsupported == (("repetition_penalty", 1.3),)
    with caplog.at_level(logging.WARNING, logger="selfspec.serve"):
        Service(tiny_model(), None, DecodeConfig(mode="ar"), ServiceOptions(model_id="m", defaults=d))
    said = [r.getMessage() for r in caplog.records if "repetition_penalty" in r.getMessage()]
    assert len(said) == 1 and "not applied" in said[0]
