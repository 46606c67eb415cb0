"""Incremental detokenization for streaming, never emitting half of a multi-byte character."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from .tokenizer import TextTokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, with the tokenizers library's DecodeStream.

    DecodeStream keeps the byte-level merges and leading-space rules right by decoding a short window,
    and holds back a token that ends inside a UTF-8 sequence until the tokens that finish it arrive.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer.tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty)."""
        return self._stream.step(self.tokenizer, token_id) or ""

    def flush(self) -> str:
        """What is still held back at the end: only bytes of a character the stream never finished, which
        no text can show, so nothing."""
        return ""
