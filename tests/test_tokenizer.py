"""The shipped sentencepiece tokenizer accepts what HF tokenizers accept: `decode` of one int, a
list, a 1-D or 2-D tensor, `batch_decode`, `encode` with HF's arguments for one string; so HF's
streamers (`TextStreamer`, `TextIteratorStreamer`), which decode a single int after every line
break, stream the shipped model's output to the end."""

import os
import threading

import numpy as np
import pytest
import torch
from transformers import TextIteratorStreamer, TextStreamer

import selfspec
from selfspec.checkpoint.tokenizer import SentencePieceTokenizer

from conftest import SHIPPED

CODE = "def f(x):\n    return x\n"
needs_shipped = pytest.mark.skipif(not os.path.isfile(os.path.join(SHIPPED, "model.safetensors")),
                                   reason="the shipped model is not in this checkout")


@pytest.fixture(scope="module")
def tok():
    return SentencePieceTokenizer(os.path.join(SHIPPED, "tokenizer.model"))


def test_decode_takes_an_int_a_list_and_1d_tensors_like_hf(tok):
    ids = tok.encode(CODE)
    assert tok.decode(ids) == tok.decode(tuple(ids)) == tok.decode(torch.tensor(ids)) == tok.decode(np.array(ids)) == CODE
    assert tok.decode(ids[0]) == tok.decode([ids[0]]) == tok.decode(torch.tensor(ids[0])) == tok.decode(np.int64(ids[0]))
    assert tok.decode([]) == ""
    assert tok.decode([tok.eos_token_id]) == "" and tok.decode(tok.eos_token_id) == ""


def test_decode_of_a_batch_and_batch_decode_give_one_string_per_row(tok):
    ids = tok.encode(CODE)
    assert tok.decode(torch.tensor([ids])) == [CODE]  # a 2-D tensor is a batch, as in HF
    assert tok.decode([ids, ids[:3]]) == [CODE, tok.decode(ids[:3])]
    assert tok.batch_decode(torch.tensor([ids, ids])) == [CODE, CODE]
    assert tok.batch_decode([ids]) == [CODE] and tok.batch_decode(ids) == [CODE] and tok.batch_decode([]) == []


def test_encode_takes_hf_arguments_for_one_string(tok):
    ids = tok.encode(CODE)
    assert torch.equal(tok.encode(CODE, return_tensors="pt"), torch.tensor([ids]))
    assert tok.encode(CODE, return_tensors="np").tolist() == [ids]
    assert tok.encode(CODE, add_special_tokens=True) == [tok.bos_token_id, *ids]
    assert tok.encode(CODE, truncation=True, max_length=3) == ids[:3]
    assert tok.encode("ab", padding="max_length", max_length=4)[-1] == tok.pad_token_id
    enc = tok(CODE, return_tensors="pt")
    assert torch.equal(enc.input_ids, torch.tensor([ids])) and enc["attention_mask"].sum() == len(ids)
    with pytest.raises(TypeError, match="one string"):
        tok.encode(["a", "b"])


@pytest.fixture(scope="module")
def shipped():
    return selfspec.load(SHIPPED)


PROMPT = "import os\n\n\ndef read_lines(path):\n"


@needs_shipped
@pytest.mark.parametrize("mode", ["ar", "presto"])
def test_text_iterator_streamer_streams_the_shipped_models_lines_to_the_end(shipped, mode):
    model, tok = shipped
    streamer = TextIteratorStreamer(tok, skip_prompt=True, timeout=120)
    result, errors = {}, []

    def run():
        try:
            result["gen"] = selfspec.generate(model, tok, PROMPT, max_new_tokens=48, mode=mode, streamer=streamer,
                                              eos_token_id=[])
        except BaseException as e:  # noqa: BLE001 -- a crash in the thread is what this test looks for
            errors.append(e)
            streamer.end()

    t = threading.Thread(target=run)
    t.start()
    streamed = "".join(streamer)
    t.join()
    assert errors == [], f"the generation thread crashed: {errors!r}"
    gen = result["gen"]
    assert gen.text.count("\n") >= 2  # line breaks are what broke the streamer
    assert streamed == gen.text


@needs_shipped
def test_text_streamer_prints_the_shipped_models_lines_exactly(shipped, capsys):
    model, tok = shipped
    gen = selfspec.generate(model, tok, PROMPT, max_new_tokens=48, mode="presto", schedule="one-pass", streamer=TextStreamer(tok, skip_prompt=True),
                            eos_token_id=[])
    assert gen.text.count("\n") >= 2
    assert capsys.readouterr().out == gen.text + "\n"  # TextStreamer ends with a newline of its own
