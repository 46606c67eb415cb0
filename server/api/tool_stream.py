"""A streamed reply that may be tool calls, as OpenAI chunks: plain content passes on (up to a call that
follows it); each call's name
goes out as soon as it is generated, with its index and id, and then its arguments as deltas while
they are generated (the shapes of OpenAI's and vLLM's streams).

A call is `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` (tools.py). One whose name does
not come first, or that names no offered function, is held back and parsed at the end instead.
"""
from __future__ import annotations

import re
import secrets

from .tools import OPEN_TAG, parse_tool_calls

CLOSE_TAG = "</tool_call>"
_HEAD = re.compile(r'\s*<tool_call>\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_.-]*)"\s*,\s*"arguments"\s*:\s*')
_HEAD_MAX = 256  # past this much text without a recognisable head, the call is parsed at the end


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin a `<tool_call>` tag."""
    return next((n for n in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1) if OPEN_TAG.startswith(text[-n:])), 0)


class ToolCallStream:
    """Feeds on the reply's text; gives the content to pass on and the tool-call deltas to send."""

    def __init__(self, names: set[str], forced: bool) -> None:
        self.names, self.forced = names, forced
        self.mode = "start"  # start | content | head | arguments | tail | between | held
        self.buf = ""  # text not consumed yet
        self.held = ""  # the whole reply since the calls began, for a parse at the end
        self.calls = 0  # calls begun (their deltas sent)
        self.complete = 0  # of which ended with </tool_call>
        self._kind: str | None = None  # the arguments value: container | string | bare (number, literal)
        self._depth, self._in_string, self._escape = 0, False, False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self.mode == "held":
            self.held += text
            return "", []
        self.buf += text
        content, deltas = "", []
        while self.buf:
            before = (self.mode, len(self.buf))
            if self.mode == "start":
                head = self.buf.lstrip()
                if not self.forced and not head.startswith(OPEN_TAG) and not OPEN_TAG.startswith(head):
                    self.mode = "content"
                elif head.startswith(OPEN_TAG) or self.forced:
                    self.mode = "head"
                else:
                    break  # it may still become a call: wait for more
            elif self.mode == "content":  # text, until a call begins (a partial tag at the end waits)
                at = self.buf.find(OPEN_TAG)
                cut = at if at >= 0 else len(self.buf) - _partial_tag(self.buf)
                content, self.buf = content + self.buf[:cut], self.buf[cut:]
                if at >= 0:
                    self.mode = "head"
            elif self.mode == "head":
                self._head(deltas)
            elif self.mode == "arguments":
                self._arguments(deltas)
            elif self.mode == "tail":
                end = self.buf.find(CLOSE_TAG)
                if end < 0:
                    break
                self.buf, self.mode, self.complete = self.buf[end + len(CLOSE_TAG):], "between", self.complete + 1
            elif self.mode == "between":
                head = self.buf.lstrip()
                if head.startswith(OPEN_TAG):
                    self.mode = "head"
                elif OPEN_TAG.startswith(head):
                    break
                else:  # text after the calls: content, as the whole-reply parse would keep it
                    self.mode = "content"
            else:  # held: parsed at the end
                break
            if (self.mode, len(self.buf)) == before:
                break
        return content, deltas

    def _head(self, deltas: list[dict]) -> None:
        m = _HEAD.match(self.buf)
        if m is None and len(self.buf) <= _HEAD_MAX and CLOSE_TAG not in self.buf:
            return  # it may still become a head: wait for more
        if m is None or m.group(1) not in self.names:
            self.mode, self.held, self.buf = "held", self.buf, ""
            return
        deltas.append({"index": self.calls, "id": "call_" + secrets.token_hex(12), "type": "function",
                       "function": {"name": m.group(1), "arguments": ""}})
        self.calls += 1
        self.buf, self.mode = self.buf[m.end():], "arguments"
        self._kind, self._depth, self._in_string, self._escape = None, 0, False, False

    def _arguments(self, deltas: list[dict]) -> None:
        """Pass on the arguments' JSON up to where its value ends: an object or array once its brackets
        close, a string once its quote does, a number or literal before the character after it."""
        taken, done = 0, False
        for c in self.buf:
            if self._kind is None:
                if not c.isspace():
                    self._kind = "container" if c in "{[" else "string" if c == '"' else "bare"
                    self._depth, self._in_string = (1, False) if c in "{[" else (0, c == '"')
                taken += 1
                if self._kind == "bare" and c in ",}":
                    taken -= 1
                    done = True
                    break
                continue
            if self._kind == "bare":
                if c in ",}" or c.isspace():
                    done = True
                    break
            elif self._in_string:
                self._escape, self._in_string = (False, True) if self._escape else (c == "\\", c != '"')
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
            taken += 1
            if self._kind != "bare" and self._depth == 0 and not self._in_string:
                done = True
                break
        if taken:
            deltas.append({"index": self.calls - 1, "function": {"arguments": self.buf[:taken]}})
        self.buf = self.buf[taken:]
        if done:
            self.mode = "tail"

    def finish(self) -> tuple[str, list[dict]]:
        """At the end: (content still held back, the deltas of calls parsed only now). A call cut short stays
        as far as it was streamed; a forced reply's leftover is never content."""
        if self.mode == "start":
            return ("" if self.forced else self.buf), []
        if self.mode == "content":
            return self.buf, []
        if self.mode != "held":
            return "", []
        content, calls = parse_tool_calls(self.held, self.names, self.forced)
        deltas = [{"index": self.calls + k, **call} for k, call in enumerate(calls)]
        self.calls += len(calls)
        self.complete += len(calls)
        return content or "", deltas
