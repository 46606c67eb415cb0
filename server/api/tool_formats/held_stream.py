"""Streaming for formats whose calls are parsed whole: content passes on up to where calls begin, and the
rest is held and parsed at the end, each call then sent whole (its name and all its arguments at once).
Nothing of the calls' markup reaches the client, and a held text that turns out to hold no call is content."""
from __future__ import annotations

from collections.abc import Callable

from .base import Offered

# (text so far, whether nothing has gone out yet) -> (how many leading characters are surely content,
# whether calls begin right after them)
Splitter = Callable[[str, bool], tuple[int, bool]]
Parser = Callable[[str, Offered], tuple[str | None, list[dict]]]


class HeldCallStream:
    def __init__(self, names: Offered, split: Splitter, parse: Parser) -> None:
        self.names, self.split, self.parse = names, split, parse
        self.buf = ""  # content not sent yet: it may still be where calls begin
        self.held: str | None = None  # the text from where calls begin, once they have
        self.sent = False
        self.calls = 0
        self.complete = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.held is not None:
            self.held += text
            return "", []
        self.buf += text
        n, begins = self.split(self.buf, not self.sent)
        content, self.buf = self.buf[:n], self.buf[n:]
        if begins:
            self.held, self.buf = self.buf, ""
        self.sent = self.sent or bool(content)
        return content, []

    def finish(self) -> tuple[str, list[dict]]:
        if self.held is None:
            rest, self.buf = self.buf, ""
            return rest, []
        content, calls = self.parse(self.held, self.names)
        deltas = [{"index": self.calls + k, **call} for k, call in enumerate(calls)]
        self.calls += len(calls)
        self.complete += len(calls)
        return content or "", deltas
