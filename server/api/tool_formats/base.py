"""What a tool-call format is: how a reply's calls are parsed, whole and streamed, and how an earlier call
and its result are written back into the chat the template renders."""
from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ...engine.forced_calls import Layout, hermes
from ..schemas import ChatMessage


class CallStream(Protocol):
    """A streamed reply's calls: feed(text) and finish() give (content to pass on, OpenAI call deltas)."""

    calls: int  # calls begun
    complete: int  # of which were complete

    def feed(self, text: str) -> tuple[str, list[dict]]: ...

    def finish(self) -> tuple[str, list[dict]]: ...


class ChannelStream(Protocol):
    """A streamed reply whose reasoning, content and calls are read together (gpt-oss's channels):
    feed(text) and finish() give (reasoning, content, OpenAI call deltas)."""

    calls: int
    complete: int
    reasoning_pieces: int  # pieces fed up to the last that was reasoning

    def feed(self, text: str) -> tuple[str, str, list[dict]]: ...

    def finish(self) -> tuple[str, str, list[dict]]: ...


# the functions a reply may call: each one's parameters schema by its name (a format that types the
# arguments it reads, such as Qwen3-Coder's, reads the schemas; the others only the names)
Offered = Mapping[str, Any]


@dataclass(frozen=True)
class ToolFormat:
    name: str
    # a reply's text and the offered functions -> (its content, or None; its complete calls of them, OpenAI-shaped)
    parse: Callable[[str, Offered], tuple[str | None, list[dict]]]
    stream: Callable[[Offered], CallStream]  # the same, piece by piece
    history: Callable[[ChatMessage], dict[str, Any]]  # an earlier message as the template takes it
    # its markers are control tokens in its models' vocabularies: a reply offered tools keeps special tokens
    # in its text, or they would vanish from it
    keeps_special_tokens: bool = False
    # a format whose replies are channels (harmony): reasoning, content and calls read by one stream, not
    # through think blocks; its markers stay in every reply's text, tools offered or not
    channels: Callable[[Offered], ChannelStream] | None = None
    ends: tuple[str, ...] = ()  # a channels format's markers that end generation: stop strings too, where not EOS
    forced: Layout = hermes  # how a forced reply's grammar writes its calls (engine/forced_calls.py)
    call_end: str | None = None  # what ends each call, where calls have one: a call said again ends the reply


def openai_call(name: str, arguments: Any) -> dict:
    """A parsed call in OpenAI's shape: its arguments as JSON text (one given as text is taken as it is)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": "call_" + secrets.token_hex(12), "type": "function", "function": {"name": name, "arguments": text}}


def json_values(text: str) -> list[Any] | None:
    """The JSON values `text` holds one after another (separated by whitespace or ';'), or None if it holds
    anything else, or nothing."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return values or None
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)


def json_types(schema: Any, alternatives: bool = True) -> set[str]:
    """The JSON types a parameter's schema allows, its anyOf/oneOf alternatives' too (one level of them)."""
    if not isinstance(schema, Mapping):
        return set()
    named = schema.get("type")
    named = [named] if isinstance(named, str) else named if isinstance(named, list) else []
    types = {t for t in named if isinstance(t, str)}
    for key in ("anyOf", "oneOf") if alternatives else ():
        if isinstance(schema.get(key), list):
            types = types.union(*(json_types(alternative, False) for alternative in schema[key]))
    return types
