"""A reply's think block (Qwen3, DeepSeek-R1 and their kin): `<think>reasoning</think>content`, split apart.

The reply opens the block itself, or the prompt already did (a template that ends its generation prompt with
`<think>\\n`): then the reply starts inside it. A block the reply never closes (max_tokens hit) is all
reasoning, and the content is empty. Only a block at the very start counts: a `<think>` later in the text is
the content's own. The reasoning loses the newlines around it and the content the whitespace before it, as
the templates write a block back (`<think>\\n` reasoning `\\n</think>\\n\\n` content).

Streamed, nothing that could still be part of a tag, or the newlines before `</think>`, goes out early, so
the pieces add up to exactly what the whole reply splits into.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


def opens_thought(prompt: str) -> bool:
    """Whether the rendered prompt leaves the reply inside a think block."""
    return prompt.rstrip().endswith(OPEN)


class ReasoningStream:
    """Feeds on a reply's text, one token's piece at a time; gives (reasoning, content) to pass on."""

    def __init__(self, opened: bool) -> None:
        self.mode = "thinking" if opened else "start"  # start (undecided) | thinking | content
        self.had_block = opened  # whether the reply has a think block at all
        self.buf = ""  # text held back: the start of a tag, or the newlines that may come before </think>
        self.reasoning_begun = False  # newlines before the reasoning are dropped until its first text
        self.content_begun = False  # whitespace after the block is dropped until the content's first text
        self.pieces = 0  # pieces fed (tokens, when fed one each)
        self.reasoning_pieces = 0  # of which made the think block, up to the one that closed it

    def feed(self, text: str) -> tuple[str, str]:
        self.pieces += 1
        self.buf += text
        reasoning = content = ""
        while True:
            if self.mode == "start":
                head = self.buf.lstrip()
                if head.startswith(OPEN):
                    self.buf, self.mode, self.had_block = head[len(OPEN):], "thinking", True
                    continue
                if OPEN.startswith(head):
                    break  # blank so far, or the start of <think>: wait for more
                self.mode = "content"  # no block: the text is all content, as it came
                continue
            if self.mode == "thinking":
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning += self._reasoning(self.buf[:end].rstrip("\n"))
                    self.buf, self.mode, self.reasoning_pieces = self.buf[end + len(CLOSE):], "content", self.pieces
                    continue
                keep = partial_tag(self.buf, CLOSE)
                body = self.buf[:len(self.buf) - keep]
                sure = body.rstrip("\n")
                reasoning += self._reasoning(sure)
                self.buf = self.buf[len(sure):]
                break
            content += self._content(self.buf)
            self.buf = ""
            break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back, at the end of the reply."""
        held, self.buf = self.buf, ""
        if self.mode == "thinking":  # never closed: all of it was reasoning
            self.reasoning_pieces = self.pieces
            return self._reasoning(held.rstrip("\n")), ""
        return "", (held if self.mode == "start" else self._content(held))

    def _reasoning(self, text: str) -> str:
        if not self.reasoning_begun:
            text = text.lstrip("\n")
            self.reasoning_begun = bool(text)
        return text

    def _content(self, text: str) -> str:
        if self.had_block and not self.content_begun:
            text = text.lstrip()
            self.content_begun = bool(text)
        return text
