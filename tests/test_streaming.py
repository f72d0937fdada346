import pytest
import torch
from transformers import TextIteratorStreamer

from types import SimpleNamespace

from selfspec.engine.schedule.decoder import Stats
from selfspec.streaming import Generation, IncrementalDetokenizer, RowResult, generate, stream

from conftest import tiny_model


class ByteTokenizer:
    """ids 5..260 are the bytes 0..255; 0-4 are specials. Decoding replaces broken UTF-8."""

    eos_token_id = 2
    bos_token_id = 1
    chat_template = None

    def encode(self, text, **_):
        return [b + 5 for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens=True, **_):
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        return bytes(i - 5 for i in ids if i >= 5).decode("utf-8", errors="replace")


class FakeDecoder:
    """Yields fixed chunks of token ids for row 0, as `engine.decoder.Decoder` does turn by turn."""

    def __init__(self, chunks, eos=()):
        self.chunks, self.eos, self.stats = chunks, set(eos), [Stats()]
        self.params, self.sequences = [SimpleNamespace(max_new_tokens=10**6)], [None]
        self.closed = self.cancelled = False

    def __iter__(self):
        try:
            for chunk in self.chunks:
                if self.cancelled:
                    return
                yield 0, chunk
        finally:
            self.closed = True

    def cancel(self, seq):
        self.cancelled = True


def _gen(dec, stop=()):
    return Generation(dec, TOK, [RowResult([5], stats=dec.stats[0])], list(stop))


TOK = ByteTokenizer()


def _chunks(*texts):
    return [TOK.encode(t) for t in texts]


def test_multibyte_characters_are_never_split():
    d = IncrementalDetokenizer(TOK)
    e = TOK.encode("é")
    assert d.push(e[:1]) == ""
    assert d.push(e[1:]) == "é"
    emoji = TOK.encode("a🙂b")
    out = "".join(d.push([i]) for i in emoji)
    assert out == "a🙂b"


def test_deltas_concatenate_to_the_full_decode():
    text = "def f(x):\n    return 'ünï' + x  # 中文\n"
    ids = TOK.encode(text)
    d = IncrementalDetokenizer(TOK)
    pieces = [d.push(ids[i : i + 3]) for i in range(0, len(ids), 3)] + [d.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_split_across_two_rounds_is_held_back_and_cut():
    gen = _gen(FakeDecoder(_chunks("x = 1\n", "#", "# end", "more")), stop=["\n##"])
    deltas = list(gen)
    assert "".join(deltas) == gen.text == "x = 1"
    assert gen.finish_reason == "stop_string"
    assert TOK.decode(gen.token_ids) == "x = 1\n##"  # ids end with the token completing the stop


def test_text_resembling_a_stop_prefix_is_released_when_it_is_not_one():
    gen = _gen(FakeDecoder(_chunks("a\n", "#b", "c")), stop=["\n##"])
    assert "".join(gen) == "a\n#bc" and gen.finish_reason == "length"


def test_eos_finish_reason_and_special_tokens_are_not_text():
    gen = _gen(FakeDecoder([TOK.encode("hi") + [2]], eos=[2]))
    assert "".join(gen) == "hi" and gen.finish_reason == "eos"


def test_closing_the_stream_early_closes_the_decoder():
    dec = FakeDecoder(_chunks("ab", "cd", "ef"))
    it = iter(_gen(dec))
    assert next(it) == "ab"
    it.close()
    assert dec.closed


@pytest.mark.parametrize("mode", ["ar", "linear", "presto"])
def test_hf_text_iterator_streamer_receives_exactly_the_generated_text(mode):
    model = tiny_model(vocab_size=261)
    streamer = TextIteratorStreamer(TOK, skip_prompt=True)
    gen = generate(model, TOK, "def f", max_new_tokens=20, mode=mode, block_length=4, streamer=streamer, eos_token_id=[])
    assert "".join(streamer) == gen.text == TOK.decode(gen.token_ids)
    assert len(gen.token_ids) == 20 and gen.stats.new_tokens == 20


def test_stream_and_generate_agree_and_text_is_the_ar_text():
    model = tiny_model(vocab_size=261)
    ar = generate(model, TOK, "import os\n", max_new_tokens=24, mode="ar", eos_token_id=[])
    deltas = list(stream(model, TOK, "import os\n", max_new_tokens=24, mode="presto", schedule="one-pass", block_length=8, eos_token_id=[]))
    assert "".join(deltas) == ar.text


def test_bad_prompts_fail_clearly():
    model = tiny_model(vocab_size=261)
    with pytest.raises(ValueError, match="empty prompt"):
        stream(model, TOK, "")
    with pytest.raises(ValueError, match="chat template"):
        stream(model, TOK, [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="stop strings"):
        stream(model, TOK, "x", stop=[""])
