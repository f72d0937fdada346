"""Tokenizers: the shipped model's sentencepiece BPE, or a checkpoint's own HF tokenizer.

`SentencePieceTokenizer` is a thin wrapper with the slice of the HF tokenizer surface that the
runtime and HF streamers use (encode / decode / eos_token_id / bos_token_id), so code round-trips
exactly: no dummy prefix, no whitespace folding, byte fallback for anything unseen.
"""

from __future__ import annotations

import json
import os

SPECIALS = {"unk": 0, "bos": 1, "eos": 2, "pad": 3, "mask": 4}
SP_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
HF_CONFIG = "tokenizer_config.json"
SLOW_FILES = ("vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")


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
        try:
            self.sp = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError) as e:  # sentencepiece's own "could not parse ModelProto"
            raise ValueError(f"tokenizer file {model_file} is corrupt or not a sentencepiece model "
                             f"({_first_line(e)})") from None
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

    def encode(self, text: str, *, add_special_tokens: bool = False, truncation: bool | str | None = None,
               max_length: int | None = None, padding: bool | str = False, padding_side: str | None = None,
               return_tensors: str | None = None, **_):
        """One string -> ids, with the arguments HF's `encode` takes for one string: a list, or a
        [1, L] tensor / array for return_tensors "pt" / "np". No BOS unless add_special_tokens (the
        shipped model was trained without one); `truncation` cuts to `max_length`; padding
        "max_length" pads to it with the pad id (on `padding_side`, default right)."""
        ids, _ = self._encode(text, add_special_tokens, truncation, max_length, padding, padding_side)
        return _as(ids, return_tensors)

    def __call__(self, text: str, *, return_tensors: str | None = None, **kw):
        """`encode` as HF's tokenizer call: a BatchEncoding with input_ids and attention_mask."""
        from transformers import BatchEncoding

        ids, mask = self._encode(text, kw.get("add_special_tokens", False), kw.get("truncation"),
                                 kw.get("max_length"), kw.get("padding", False), kw.get("padding_side"))
        return BatchEncoding({"input_ids": _as(ids, return_tensors), "attention_mask": _as(mask, return_tensors)})

    def _encode(self, text, add_special_tokens, truncation, max_length, padding, padding_side):
        if not isinstance(text, str):
            raise TypeError(f"encode takes one string, got {type(text).__name__}")
        ids = self.sp.encode(text)
        if add_special_tokens:
            ids = [self.bos_token_id, *ids]
        if truncation not in (None, False, "do_not_truncate") and max_length is not None:
            ids = ids[:max_length]
        mask = [1] * len(ids)
        if padding == "max_length" and max_length is not None and len(ids) < max_length:
            n = max_length - len(ids)
            left = padding_side == "left"
            ids = [self.pad_token_id] * n + ids if left else ids + [self.pad_token_id] * n
            mask = [0] * n + mask if left else mask + [0] * n
        return ids, mask

    def decode(self, token_ids, skip_special_tokens: bool = True, **_) -> str | list[str]:
        """Ids -> text, as HF's `decode`: one int, a list of ints or a 1-D tensor / array -> a str
        (HF streamers decode a single int after a line break); a batch (a list of lists, a 2-D
        tensor, one row or more) -> a list of str. Specials are skipped unless asked otherwise."""
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else token_ids
        if isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple)):
            return [self._decode(row, skip_special_tokens) for row in ids]
        return self._decode([ids] if isinstance(ids, int) else ids, skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = True, **kw) -> list[str]:
        """A batch of id sequences -> one str each (a single sequence -> a list of one, as HF)."""
        out = self.decode(sequences, skip_special_tokens=skip_special_tokens, **kw)
        rows = sequences.tolist() if hasattr(sequences, "tolist") else sequences
        return out if isinstance(out, list) else ([] if not rows else [out])

    def _decode(self, ids, skip_special_tokens: bool) -> str:
        ids = [int(i) for i in ids]
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


def _as(ids: list[int], return_tensors: str | None):
    """A list as HF returns it for one string: itself, or a [1, L] tensor ("pt") / array ("np")."""
    if return_tensors is None:
        return ids
    if return_tensors == "pt":
        import torch

        return torch.tensor([ids], dtype=torch.long)
    if return_tensors == "np":
        import numpy as np

        return np.array([ids], dtype=np.int64)
    raise ValueError(f"return_tensors must be 'pt', 'np' or None, got {return_tensors!r}")


def load_tokenizer(path: str):
    """The checkpoint's own tokenizer: sentencepiece file if present (and no tokenizer.json), else
    `AutoTokenizer`. A missing tokenizer file is a FileNotFoundError naming it, a corrupt one a
    ValueError naming it (not what sentencepiece or transformers say about them)."""
    sp, hf = os.path.join(path, SP_FILE), os.path.join(path, HF_FILE)
    if os.path.isfile(sp) and not os.path.isfile(hf):
        return SentencePieceTokenizer(sp)
    if not os.path.isfile(hf) and not os.path.isfile(os.path.join(path, HF_CONFIG)):
        # selfspec's own checkpoints (the shipped one, `selfspec.training`) carry tokenizer.model alone
        raise FileNotFoundError(f"tokenizer file {sp} not found (the checkpoint {path} has neither {SP_FILE} "
                                f"nor {HF_FILE})")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' errors about these files never name them
        raise _hf_file_error(path, e) from None


def _hf_file_error(path: str, error: Exception) -> Exception:
    """What made `AutoTokenizer` fail, in terms of the checkpoint's files; `error` itself when no
    file is missing or unreadable."""
    hf, cfg = os.path.join(path, HF_FILE), os.path.join(path, HF_CONFIG)
    if os.path.isfile(cfg):
        try:
            with open(cfg, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, OSError) as e:
            return ValueError(f"tokenizer file {cfg} is corrupt or not JSON ({_first_line(e)})")
    if not os.path.isfile(hf):
        if any(os.path.isfile(os.path.join(path, f)) for f in SLOW_FILES):
            return error  # a slow tokenizer's files are there: transformers' word is the one to read
        return FileNotFoundError(f"tokenizer file {hf} not found ({HF_CONFIG} names a transformers tokenizer, "
                                 f"whose vocabulary is in {HF_FILE})")
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(hf)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
        return ValueError(f"tokenizer file {hf} is corrupt or not a tokenizers file ({_first_line(e)})")
    return error


def _first_line(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [type(e).__name__]
    line = lines[0]
    return line if len(line) <= 160 else line[:157] + "..."


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
