"""A prompt's size before it is tokenized: what lets the server refuse a prompt that cannot fit
without tokenizing it, and tokenize the others off the event loop.

Tokenizing is the one request-sized piece of work on the way in, and it does not fully release the
GIL: megabytes of text take seconds of CPU that every running stream would wait behind. So:

- `text_bytes_per_token(tok)` is K, the most UTF-8 bytes of text one token of this tokenizer can
  stand for: the longest of its pieces, measured both as stored (byte-level BPE stores a byte as
  one character of up to 2 bytes, sentencepiece a space as the 3-byte U+2581 and a fallback byte
  as "<0xAB>") and as decoded; each is at least the bytes the token stands for. Where the tokenizer
  is lossless (decode(encode(text)) == text: nothing folded, stripped or composed), a text of B
  bytes is the concatenation of its tokens' texts, so it has at least B / K tokens; a prompt of
  more than K x (the most tokens a prompt may have) bytes is over the context for certain and is
  refused without tokenizing it. Losslessness is checked on a probe of the usual shrinking
  normalizations (whitespace runs and trims, combining marks, NFKC folds, Hangul jamo); a
  tokenizer that fails it gets no such bound (None) and relies on the body limit alone.
- `prompt_bytes(prompt)`: the UTF-8 bytes of a request's text (a chat: its messages' contents,
  trimmed, as chat templates commonly trim them), or a 400 saying which part cannot be encoded
  (a lone surrogate, which JSON's "\\ud800" escape can carry).
"""

from __future__ import annotations

from selfspec.serving.openai_api.errors import invalid

# what normalizers fold or drop: runs of spaces, tabs and line ends, leading / trailing space, a
# combining accent, Hangul jamo, a ligature, the angstrom sign, no-break and zero-width spaces
PROBE = "  a  b\t\t c\n\n\n  d   \r\n e\u0301 \u1100\u1161\u11a8 \ufb01 \u212b x\u00a0y \u3000z\u200b end  "


def text_bytes_per_token(tok) -> int | None:
    """K (see the module docstring), or None where the tokenizer is not lossless on PROBE."""
    try:
        ids = tok.encode(PROBE, add_special_tokens=False)
        if tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False) != PROBE:
            return None
        every = list(range(len(tok)))
        pieces = tok.convert_ids_to_tokens(every)
        texts = tok.batch_decode([[i] for i in every], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    except Exception:  # noqa: BLE001 - a tokenizer without this surface gets no bound, never a failed start
        return None
    sizes = [len(s.encode("utf-8", "replace")) for s in (*pieces, *texts) if isinstance(s, str)]
    return max(sizes) if sizes else None


def prompt_bytes(prompt) -> int:
    """UTF-8 bytes of a prompt's text (0 for token ids); a 400 where some text is not encodable."""
    if isinstance(prompt, str):
        return _utf8(prompt, "prompt")
    if prompt and isinstance(prompt[0], dict):
        return sum(_utf8(m["content"].strip(), f"messages[{i}].content") for i, m in enumerate(prompt))
    return 0


def _utf8(text: str, where: str) -> int:
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:
        char = text[e.start]
        raise invalid(f"the prompt cannot be encoded: {where} holds U+{ord(char):04X} at character {e.start}, a lone "
                      f"surrogate that is not valid Unicode text (UTF-8 cannot encode it)",
                      where, "invalid_prompt") from None
