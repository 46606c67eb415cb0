"""Llama 3.1-3.3's tool calls: the reply is a JSON object `{"name": ..., "parameters": {...}}` ("arguments"
in some fine-tunes), after `<|python_tag|>` at times (a control token the detokenizer usually drops
already), several separated by ';' (3.2's small models). A reply that is anything else, or JSON that is not
calls of offered functions, is content: calls are the whole reply or nothing."""
from __future__ import annotations

from typing import Any

from ...engine.forced_calls import OfferedCalls
from ..chat_messages import structured_message
from .base import ToolFormat, json_values, openai_call
from .held_stream import HeldCallStream

PYTHON_TAG = "<|python_tag|>"


def _body(text: str) -> str:
    body = text.strip()
    return body[len(PYTHON_TAG):].strip() if body.startswith(PYTHON_TAG) else body


def _call(value: Any, names: set[str]) -> dict | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("parameters", value.get("arguments", {}))
    if isinstance(arguments, str):  # arguments given as JSON text: the object it holds
        values = json_values(arguments)
        arguments = values[0] if values and len(values) == 1 else arguments
    return openai_call(value["name"], arguments) if isinstance(arguments, dict) else None


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    values = json_values(_body(text)) if names else None
    calls = [_call(v, names) for v in values or ()]
    if not calls or None in calls:
        return text, []
    return None, calls


def split(text: str, at_start: bool) -> tuple[int, bool]:
    """Calls begin only where the reply does: with '{' or the python tag."""
    head = text.lstrip()
    if not at_start:
        return len(text), False
    if head.startswith("{") or head.startswith(PYTHON_TAG):
        return 0, True
    if not head or PYTHON_TAG.startswith(head):
        return 0, False  # blank so far, or the start of the tag: wait for more
    return len(text), False


def forced(calls: OfferedCalls, parallel: bool) -> str:
    """One call, as the templates write it (3.2's raise on more than one a turn)."""
    return f"start: {calls.each(lambda i: calls.call_object(i, 'parameters'))}"


FORMAT = ToolFormat(
    name="llama3_json",
    parse=parse,
    stream=lambda names: HeldCallStream(names, split, parse),
    history=structured_message,
    forced=forced,
)
