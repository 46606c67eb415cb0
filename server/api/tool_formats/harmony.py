"""gpt-oss's "harmony" replies: messages on channels, reasoning, calls and content in one text.

The prompt ends with `<|start|>assistant`; the reply is one or more messages, each a header, `<|message|>`
and a body that `<|end|>` closes (another message follows, after `<|start|>` and its role):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

or, answering, `...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`. The recipient
(`to=functions.NAME`) stands in the channel's header or after the role. `<|call|>` and `<|return|>` end the
reply (they end generation: nothing after them is the model's).

What each message is: one addressed to an offered function is a call, its body the arguments (JSON; a call
whose arguments are not a JSON object, as one cut short, is dropped, never shown). One addressed elsewhere
(a built-in tool such as browser.search, a function not offered) is the model's own working: reasoning, as
the analysis channel is. The final and commentary channels are content (a commentary message without a
recipient is a preamble meant for the user), and so is a message on an unknown channel or with no header:
text that is not harmony is content, as it came. Several messages of a kind are joined by a blank line.

Streamed, a header is held until its `<|message|>` (or until it can no longer be one: then it is content),
a body's end that could begin a marker is held, and a call goes out whole when its message ends; the
pieces add up to exactly what the whole reply reads as. The markers are control tokens in gpt-oss's
vocabulary, so its replies keep special tokens in their text. Earlier turns go back to the template as it
takes them (llama.cpp's rule): reasoning as `thinking` (where a turn with calls has both, its text gives
way: the template takes one), calls with their arguments as objects.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..reasoning import partial_tag
from ..schemas import ChatMessage
from ..chat_messages import structured_message
from ...engine.forced_calls import OfferedCalls, text
from .base import ToolFormat, openai_call

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
ENDS = (END, CALL, RETURN, START)  # what closes a body (a new message's start closes it too, where <|end|> was missed)
LAST = (CALL, RETURN)  # ...and ends the reply
HEADER_MAX = 256  # a longer header is no header: its text is content
_HEADER_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.=: ")
SEPARATOR = "\n\n"


def _plausible(header: str, whole: bool) -> bool:
    """Whether `header` is a message header (whole: complete, up to `<|message|>`) or may still become one:
    markers and names only, opening with `<|start|>` (and a role), `<|channel|>` or a recipient."""
    if len(header) > HEADER_MAX:
        return False
    if whole and not header.strip():
        return True  # `<|message|>` with no header: a message on no channel
    cut = 0 if whole else max(partial_tag(header, m) for m in (START, CHANNEL, CONSTRAIN, MESSAGE))
    rest = header[:len(header) - cut]
    for marker in (START, CHANNEL, CONSTRAIN):
        rest = rest.replace(marker, " ")
    if not set(rest) <= _HEADER_CHARS:
        return False
    opening = header.lstrip(" ")
    return any(opening.startswith(m) or (not whole and m.startswith(opening)) for m in (START, CHANNEL, "to="))


def _header(header: str) -> tuple[str | None, str | None]:
    """A complete header's (channel, recipient): None where it names none."""
    words = header.replace(START, " ").replace(CONSTRAIN, " ").replace(CHANNEL, f" {CHANNEL}").split()
    channel = next((w[len(CHANNEL):] for w in words if w.startswith(CHANNEL)), None)
    recipient = next((w[len("to="):] for w in words if w.startswith("to=")), None)
    return channel or None, recipient


class HarmonyStream:
    """A reply's messages, piece by piece: feed(text) and finish() give (reasoning, content, call deltas)."""

    def __init__(self, functions: Mapping[str, Any]) -> None:
        self.functions = functions
        self.mode = "header"  # header | body | done (after <|call|> or <|return|>)
        self.buf = ""  # text not given out yet
        self.kind = "content"  # the open message's: reasoning | content | call
        self.name = ""  # the function a call message calls
        self.said = {"reasoning": False, "content": False}  # whether text of each kind went out (for separators)
        self.begun = False  # whether the open message's text has begun to go out
        self.calls = 0  # calls begun
        self.complete = 0  # of which were complete
        self.pieces = 0  # pieces fed
        self.reasoning_pieces = 0  # of which the last that was reasoning

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        self.pieces += 1
        self.buf += text
        out = {"reasoning": "", "content": ""}
        deltas: list[dict] = []
        while self.mode != "done" and self._step(out, deltas):
            pass
        if self.mode == "done":
            self.buf = ""
        if out["reasoning"] or (self.mode == "body" and self.kind == "reasoning"):
            self.reasoning_pieces = self.pieces
        return out["reasoning"], out["content"], deltas

    def finish(self) -> tuple[str, str, list[dict]]:
        """The end of the reply: a held body goes out; a header never finished is dropped (cut short)."""
        out = {"reasoning": "", "content": ""}
        deltas: list[dict] = []
        if self.mode == "body":
            self._close(self.buf, out, deltas)
        self.buf, self.mode = "", "done"
        return out["reasoning"], out["content"], deltas

    def _step(self, out: dict[str, str], deltas: list[dict]) -> bool:
        """One move on the held text; False where it must wait for more."""
        if self.mode == "header":
            at = self.buf.find(MESSAGE)
            if at >= 0 and _plausible(self.buf[:at], True):
                self._open(*_header(self.buf[:at]))
                self.buf = self.buf[at + len(MESSAGE):]
                return True
            if at < 0 and _plausible(self.buf, False):
                return False
            self._open(None, None)  # no header: the text is content, as it came
            return True
        ends = [(at, m) for m in ENDS if (at := self.buf.find(m)) >= 0]
        if ends:
            at, marker = min(ends)
            self._close(self.buf[:at], out, deltas)
            self.buf = self.buf[at + len(marker):]
            self.mode = "done" if marker in LAST else "header"
            if marker == START:
                self.buf = START + self.buf  # the header reads it back
            return True
        if self.kind != "call":
            keep = max(partial_tag(self.buf, m) for m in ENDS)
            self._give(self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
        return False

    def _open(self, channel: str | None, recipient: str | None) -> None:
        self.mode, self.begun = "body", False
        name = recipient[len("functions."):] if recipient is not None and recipient.startswith("functions.") else None
        if name is not None and name in self.functions:
            self.kind, self.name = "call", name
            self.calls += 1
        elif recipient is not None and recipient != "assistant" or channel == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "content"  # final, commentary, an unknown channel or none

    def _close(self, body: str, out: dict[str, str], deltas: list[dict]) -> None:
        if self.kind != "call":
            self._give(body, out)
            return
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError:
            return
        if isinstance(arguments, dict):
            deltas.append({"index": self.complete, **openai_call(self.name, arguments)})
            self.complete += 1

    def _give(self, text: str, out: dict[str, str]) -> None:
        if not text:
            return
        if not self.begun and self.said[self.kind]:
            text = SEPARATOR + text
        self.begun = self.said[self.kind] = True
        out[self.kind] += text


def read(text: str, functions: Mapping[str, Any]) -> tuple[str | None, str | None, list[dict]]:
    """A whole reply's (reasoning, content, calls): what its pieces read as, streamed."""
    stream = HarmonyStream(functions)
    parts = [stream.feed(text), stream.finish()]
    reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
    calls = [{k: v for k, v in d.items() if k != "index"} for p in parts for d in p[2]]
    return reasoning or None, content or None, calls


class _Calls:
    """The ToolFormat view of a reply: its content and calls (its reasoning is read by reply.py)."""

    def __init__(self, functions: Mapping[str, Any]) -> None:
        self.stream = HarmonyStream(functions)

    @property
    def calls(self) -> int:
        return self.stream.calls

    @property
    def complete(self) -> int:
        return self.stream.complete

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return self.stream.feed(text)[1:]

    def finish(self) -> tuple[str, list[dict]]:
        return self.stream.finish()[1:]


def history(m: ChatMessage) -> dict[str, Any]:
    out = structured_message(m)
    reasoning = out.pop("reasoning_content", None)
    if reasoning:
        out["thinking"] = reasoning
        if m.tool_calls:
            out["content"] = ""
    return out


def forced(calls: OfferedCalls, parallel: bool) -> str:
    """One call (gpt-oss calls one function a turn), after the prompt's `<|start|>assistant`, with the header
    the template writes for it."""
    m = calls.marker
    call = calls.each(lambda i: f'{text(" to=functions." + calls.names[i])} {m(CHANNEL)} "commentary json" '
                                f'{m(MESSAGE)} {calls.arguments(i)}')
    return f"start: {call} {m(CALL)}"


FORMAT = ToolFormat(
    name="harmony",
    parse=lambda text, functions: read(text, functions)[1:],
    stream=_Calls,
    history=history,
    keeps_special_tokens=True,
    channels=HarmonyStream,
    ends=LAST,
    forced=forced,
)
