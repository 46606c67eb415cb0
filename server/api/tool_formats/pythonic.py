"""LFM2's tool calls: a Python list of calls with keyword arguments between two markers,

    <|tool_call_start|>[get_weather(city='Paris', days=3)]<|tool_call_end|>

as its templates write them (a string in single quotes, a mapping as JSON, anything else as Python writes
it: True, None, 3). Text before the first marker is content; a list that does not parse (cut short), or
a call of a function not offered, is dropped, never shown. The markers are control tokens in LFM2's
vocabulary, so a reply offered tools keeps special tokens in its text. Earlier calls go back to the
template with their arguments as objects: it writes them itself.
"""
from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Any

from ...engine.forced_calls import OfferedCalls, text
from ..chat_messages import structured_message
from ..reasoning import partial_tag
from .base import ToolFormat, json_types, openai_call
from .held_stream import HeldCallStream

START, END = "<|tool_call_start|>", "<|tool_call_end|>"


def _call(node: ast.expr, names: Mapping[str, Any]) -> dict | None:
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names and not node.args):
        return None
    try:
        arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return None
    return openai_call(node.func.id, arguments)


def parse(text: str, names: Mapping[str, Any]) -> tuple[str | None, list[dict]]:
    at = text.find(START) if names else -1
    if at < 0:
        return text, []
    calls = []
    for block in text[at + len(START):].split(START):
        body = block.split(END)[0].strip()
        try:
            tree = ast.parse(body, mode="eval").body if len(body) < 100_000 else None
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            tree = None
        items = tree.elts if isinstance(tree, ast.List) else [tree] if tree is not None else []
        calls += [c for c in (_call(item, names) for item in items) if c is not None]
    content = text[:at].strip() if calls else text[:at]
    return content or None, calls


def split(text: str, at_start: bool) -> tuple[int, bool]:
    at = text.find(START)
    return (at, True) if at >= 0 else (len(text) - partial_tag(text, START), False)


def _value(calls: OfferedCalls, i: int, name: str, schema: Any) -> str:
    """A value as the templates write it: a string quoted, True/False, a number, else compact JSON."""
    types = json_types(schema)
    if not types or "string" in types:
        return '"\'" /[^\'\\n]*/ "\'"'
    if types == {"boolean"}:
        return '("True" | "False")'
    return "/-?(0|[1-9][0-9]*)/" if types == {"integer"} else calls.argument(i, name)


def forced(calls: OfferedCalls, parallel: bool) -> str:
    """The list of calls: the required arguments in the schema's order, then each optional one or not."""
    def call(i: int) -> str:
        properties, required = calls.properties(i)
        given = [n for n in properties if n in required]
        parts = [f'{text(n + "=")} {_value(calls, i, n, properties[n])}' for n in given]
        optional = [f'{text(n + "=")} {_value(calls, i, n, properties[n])}' for n in properties if n not in required]
        words = ' ", " '.join(parts)
        if words:
            words += "".join(f' (", " {part})?' for part in optional)
        elif optional:  # none required: the first optional one leads
            words = f"({optional[0]}" + "".join(f' (", " {part})?' for part in optional[1:]) + ")?"
        return f'{text(calls.names[i] + "(")} {words} ")"'
    more = ' (", " call)*' if parallel else ""
    return f'start: {calls.marker(START)} "[" call{more} "]" {calls.marker(END)}\ncall: {calls.each(call)}'


FORMAT = ToolFormat(
    name="pythonic",
    parse=parse,
    stream=lambda names: HeldCallStream(names, split, parse),
    history=structured_message,
    keeps_special_tokens=True,
    forced=forced,
)
