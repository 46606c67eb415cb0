"""Qwen3-Coder's tool calls (also Qwen3.5's, Nemotron 3 Nano's and StepFun 3.5's): XML, one block a call,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is its text less one newline on each side, typed by the offered function's schema:
text where the schema allows a string (or says nothing), else the JSON value the text holds (Python's
True/False/None too, which the template writes back for booleans and nulls) if it is of a type the schema
names, else the text as it is (as vLLM's qwen3_coder parser reads it).

Text before the first call is content; calls of unknown functions are dropped, and so is a call cut short,
which is never shown as content. A reply whose markers make no call at all (prose about the format) is all
content. Earlier calls go back to the template with their arguments as objects: it writes them itself.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from ..reasoning import partial_tag
from ..chat_messages import structured_message
from ...engine.forced_calls import OfferedCalls, text
from .base import ToolFormat, json_types, openai_call
from .held_stream import HeldCallStream

CALL, CALL_END, FUNCTION, FUNCTION_END = "<tool_call>", "</tool_call>", "<function=", "</function>"
PARAMETER = "<parameter="
# a value ends at its closing tag, or where the next parameter or the function ends without one
_VALUE_END = re.compile(r"</parameter>|<parameter=|</function>")
NL = "\n"
HELD_SPACE = 64  # whitespace held back at most, in case a call follows it
_PYTHON_LITERALS = {"True": "true", "False": "false", "None": "null"}
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", list: "array", dict: "object", type(None): "null"}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def typed_value(text: str, schema: Any) -> Any:
    types = json_types(schema)
    if not types or "string" in types:
        return text
    bare = text.strip()
    try:
        value = json.loads(_PYTHON_LITERALS.get(bare, bare), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return text
    if isinstance(value, float) and value.is_integer() and "integer" in types and "number" not in types:
        value = int(value)
    kind = _JSON_TYPES[type(value)] if type(value) in _JSON_TYPES else "string"
    fits = kind in types or (kind == "integer" and "number" in types)
    return value if fits else text


def _arguments(body: str, parameters: Any) -> dict[str, Any]:
    """A function block's parameters, each typed by its schema among the function's `parameters`."""
    properties = parameters.get("properties") if isinstance(parameters, Mapping) else None
    properties = properties if isinstance(properties, Mapping) else {}
    out, at = {}, 0
    while (start := body.find(PARAMETER, at)) >= 0:
        name_end = body.find(">", start)
        if name_end < 0:
            break
        end = _VALUE_END.search(body, name_end + 1)
        value_end = end.start() if end else len(body)
        value = body[name_end + 1:value_end]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        name = body[start + len(PARAMETER):name_end].strip()
        out[name] = typed_value(value, properties.get(name))
        at = end.end() if end and end.group() == "</parameter>" else value_end
    return out


def _start(text: str) -> int:
    """Where the calls begin: the first `<tool_call>`, or a `<function=` the model wrote without one."""
    found = [at for at in (text.find(CALL), text.find(FUNCTION)) if at >= 0]
    return min(found) if found else -1


def parse(text: str, functions: Mapping[str, Any]) -> tuple[str | None, list[dict]]:
    """`functions`: the offered functions' parameter schemas by name."""
    at = _start(text) if functions else -1
    if at < 0:
        return text, []
    calls, done = [], at  # `done`: where the last complete function block ends
    while (start := text.find(FUNCTION, done)) >= 0:
        end = text.find(FUNCTION_END, start)
        if end < 0:
            break
        name_end = text.find(">", start, end)
        done = end + len(FUNCTION_END)
        name = text[start + len(FUNCTION):name_end].strip() if name_end >= 0 else None
        if name in functions:
            calls.append(openai_call(name, _arguments(text[name_end + 1:end], functions[name])))
    rest = text[done:]  # no `<function=` in it has its end: the loop stopped there
    cut_short = FUNCTION in rest or rest.rfind(CALL) > rest.rfind(CALL_END)  # a call opened and never finished
    if not calls and not cut_short:
        return text, []
    return text[:at].rstrip() or None, calls


def split(text: str, at_start: bool) -> tuple[int, bool]:
    """Content goes on up to where calls begin, less the whitespace before them (the whole reply's content
    ends without it); a partial marker or trailing whitespace waits for what follows, the whitespace up to
    HELD_SPACE characters, so that a reply of blank lines is not scanned again at every piece."""
    at = _start(text)
    end = at if at >= 0 else len(text) - max(partial_tag(text, CALL), partial_tag(text, FUNCTION))
    return max(len(text[:end].rstrip()), end - HELD_SPACE), at >= 0


# a text value and its close, one lexeme (the grammar's lexer does not back off a value it could still
# extend): anything without "</" or "\n<" in it, not starting with a newline
TEXT_VALUE = r"/[^\n<]([^<\n]|\n[^<]|<[^\/])*\n<\/parameter>\n/"
CLOSE = '"\\n</parameter>\\n"'


def _value(calls: OfferedCalls, i: int, name: str, schema: Any) -> str:
    """A value as the template writes it, and its close: text where a string is allowed (or nothing said),
    Python's True/False for a boolean, else compact JSON."""
    types = json_types(schema)
    if not types or "string" in types:
        return TEXT_VALUE
    return f'("True" | "False") {CLOSE}' if types == {"boolean"} else f"{calls.argument(i, name)} {CLOSE}"


def forced(calls: OfferedCalls, parallel: bool) -> str:
    """Calls as the template writes them: the parameters in the schema's order, the required ones always."""
    def call(i: int) -> str:
        properties, required = calls.properties(i)
        parts = []
        for name, value in properties.items():
            part = f'{text(f"<parameter={name}>" + NL)} {_value(calls, i, name, value)}'
            parts.append(part if name in required else f"({part})?")
        return " ".join([text(f"<function={calls.names[i]}>" + NL), *parts, '"</function>"'])
    more = ' ("\\n" call)*' if parallel else ""
    return f'start: call{more}\ncall: "<tool_call>\\n" {calls.each(call)} "\\n</tool_call>"'


FORMAT = ToolFormat(
    name="qwen3_coder",
    parse=parse,
    stream=lambda functions: HeldCallStream(functions, split, parse),
    history=structured_message,
    forced=forced,
    call_end=CALL_END,
)
