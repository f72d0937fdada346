"""Tokenizers: the shipped model's sentencepiece BPE, or a checkpoint's own HF tokenizer.

`SentencePieceTokenizer` is a thin wrapper with the slice of the HF tokenizer surface that the
runtime and HF streamers use (encode / decode / eos_token_id / bos_token_id), so code round-trips
exactly: no dummy prefix, no whitespace folding, byte fallback for anything unseen.
"""

from __future__ import annotations

import os

SPECIALS = {"unk": 0, "bos": 1, "eos": 2, "pad": 3, "mask": 4}
SP_FILE = "tokenizer.model"


def text_chunks(texts, max_chars: int = 4000):
    """Split texts at line ends into pieces of at most ~max_chars (sentencepiece's unit)."""
    for text in texts:
        buf = []
        size = 0
        for line in text.splitlines(keepends=True):
            if size + len(line) > max_chars and buf:
                yield "".join(buf)
                buf, size = [], 0
            buf.append(line)
            size += len(line)
        if buf:
            yield "".join(buf)


def train_sentencepiece(texts, prefix: str, *, vocab_size: int = 8192, seed: int = 0) -> str:
    """Train a byte-fallback BPE on `texts`; returns the path of the .model file."""
    import sentencepiece as spm

    spm.set_random_generator_seed(seed)
    spm.SentencePieceTrainer.train(
        sentence_iterator=text_chunks(texts),
        model_prefix=prefix,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        character_coverage=0.9995,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        split_by_whitespace=True,
        allow_whitespace_only_pieces=True,
        split_digits=True,
        max_sentence_length=1 << 16,
        input_sentence_size=200_000,
        shuffle_input_sentence=True,
        unk_id=SPECIALS["unk"],
        bos_id=SPECIALS["bos"],
        eos_id=SPECIALS["eos"],
        pad_id=SPECIALS["pad"],
        user_defined_symbols=["<mask>"],
        num_threads=2,
        minloglevel=2,
    )
    return prefix + ".model"


class SentencePieceTokenizer:
    """HF-like wrapper around a sentencepiece model file."""

    def __init__(self, model_file: str):
        import sentencepiece as spm

        if not os.path.isfile(model_file):
            raise FileNotFoundError(f"tokenizer file {model_file} not found")
        self.sp = spm.SentencePieceProcessor(model_file=model_file)
        self.model_file = model_file
        self.bos_token_id = self.sp.bos_id()
        self.eos_token_id = self.sp.eos_id()
        self.pad_token_id = self.sp.pad_id()
        self.chat_template = None

    @classmethod
    def from_pretrained(cls, path: str) -> "SentencePieceTokenizer":
        return cls(os.path.join(path, SP_FILE))

    def __len__(self) -> int:
        return self.sp.get_piece_size()

    @property
    def vocab_size(self) -> int:
        return len(self)

    def encode(self, text: str, *, add_special_tokens: bool = False, **_) -> list[int]:
        ids = self.sp.encode(text)
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def __call__(self, text: str, **kw):
        return {"input_ids": self.encode(text, **kw)}

    def decode(self, ids, *, skip_special_tokens: bool = True, **_) -> str:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        if skip_special_tokens:
            special = set(SPECIALS.values())
            ids = [i for i in ids if i not in special]
        return self.sp.decode(ids)

    def convert_ids_to_tokens(self, ids):
        return [self.sp.id_to_piece(int(i)) for i in ids]

    def save_pretrained(self, path: str) -> None:
        import shutil

        os.makedirs(path, exist_ok=True)
        dst = os.path.join(path, SP_FILE)
        if os.path.abspath(dst) != os.path.abspath(self.model_file):
            shutil.copyfile(self.model_file, dst)


def load_tokenizer(path: str):
    """The checkpoint's own tokenizer: sentencepiece file if present, else `AutoTokenizer`."""
    if os.path.isfile(os.path.join(path, SP_FILE)) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return SentencePieceTokenizer.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class IncrementalDetokenizer:
    """Token ids in, text deltas out.

    Decodes a short window [prefix_offset:] and emits only what extends the already-emitted
    window text, and only when it does not end in U+FFFD (an unfinished UTF-8 sequence).
    Example with byte-fallback pieces for "é" (<0xC3>, <0xA9>): push([<0xC3>]) -> "",
    push([<0xA9>]) -> "é".
    """

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix) :]
        return ""

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix) :]
