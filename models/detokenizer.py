"""Incremental detokenization for streaming, never emitting half of a multi-byte character."""
from __future__ import annotations

from .tokenizer import TextTokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding a window that starts a few tokens back keeps byte-level merges and leading-space rules
    right; a delta that ends in U+FFFD is an incomplete UTF-8 sequence and is held back until the
    tokens that finish it arrive.
    """

    def __init__(self, tokenizer: TextTokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        """Add one token; return the text that is now final (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self._prefix : self._read], self.skip_special)
        full_text = decode(self.ids[self._prefix :], self.skip_special)
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            delta = full_text[len(prefix_text) :]
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back, at the end of the stream."""
        prefix_text = self.tokenizer.decode(self.ids[self._prefix : self._read], self.skip_special)
        full_text = self.tokenizer.decode(self.ids[self._prefix :], self.skip_special)
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text) :]
