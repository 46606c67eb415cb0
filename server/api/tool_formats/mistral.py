"""Mistral's tool calls: `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` objects (v3 tokenizers),
or `[TOOL_CALLS]name[ARGS]{...}` once for each call (v11 and later), with `[CALL_ID]id` after the name
where the template writes ids (Mistral Small 3.2): the id a model wrote is kept, so the call sent back
renders as it was written. Text before the first marker is
content. The markers are control tokens in Mistral's vocabularies, so a reply offered tools keeps special
tokens in its text (as vLLM decodes it), or they would vanish. Mistral's templates want the ids of earlier
calls to be 9 letters or digits: other ids are written as 9 hex digits of their hash, the same for the
call and for its result."""
from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

from ..reasoning import partial_tag
from ..schemas import ChatMessage
from ..chat_messages import structured_message
from ...engine.forced_calls import OfferedCalls, text
from .base import ToolFormat, json_values, openai_call
from .held_stream import HeldCallStream

MARKER, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def _calls(value: Any, names: set[str]) -> list[dict]:
    """Calls of offered functions in a JSON list (or one object) of {"name", "arguments"}; others dropped."""
    items = value if isinstance(value, list) else [value]
    return [_kept_id(openai_call(v["name"], v.get("arguments", {})), v.get("id")) for v in items
            if isinstance(v, dict) and v.get("name") in names and isinstance(v.get("arguments", {}), dict)]


def _kept_id(call: dict, written: Any) -> dict:
    """The call with the id the model wrote, where it wrote one a template can write back."""
    return {**call, "id": written} if isinstance(written, str) and _MISTRAL_ID.fullmatch(written) else call


def _named_call(chunk: str, names: set[str]) -> list[dict]:
    name, _, arguments = chunk.partition(ARGS)
    name, _, written_id = name.partition(CALL_ID)
    values = json_values(arguments)
    name, written_id = name.strip(), written_id.strip()
    ok = name in names and values is not None and len(values) == 1 and isinstance(values[0], dict)
    return [_kept_id(openai_call(name, values[0]), written_id)] if ok else []


def parse(text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """Calls cut short or of unknown functions are dropped, never shown as content (as Hermes's are)."""
    at = text.find(MARKER) if names else -1
    if at < 0:
        return text, []
    calls = []
    for chunk in text[at + len(MARKER):].split(MARKER):
        if ARGS in chunk:
            calls += _named_call(chunk, names)
        else:
            values = json_values(chunk)
            calls += _calls(values[0], names) if values and len(values) == 1 else []
    content = text[:at].strip() if calls else text[:at]
    return content or None, calls


def split(text: str, at_start: bool) -> tuple[int, bool]:
    at = text.find(MARKER)
    return (at, True) if at >= 0 else (len(text) - partial_tag(text, MARKER), False)


def call_id(value: str) -> str:
    return value if _MISTRAL_ID.fullmatch(value) else hashlib.sha256(value.encode()).hexdigest()[:9]


def history(m: ChatMessage) -> dict[str, Any]:
    return structured_message(m, call_id)


def forced_list(calls: OfferedCalls, parallel: bool) -> str:
    """v3 (Mistral Nemo): `[TOOL_CALLS]` and a JSON list of calls, each with the 9-character id the
    template writes after its arguments."""
    call = calls.each(lambda i: calls.call_object(i, extra={"id": {"type": "string", "pattern": "^[A-Za-z0-9]{9}$"}}))
    more = ' (", " call)*' if parallel else ""
    return f'start: {calls.marker(MARKER)} "[" call{more} "]"\ncall: {call}'


def forced_named(calls: OfferedCalls, parallel: bool) -> str:
    """v11 and later: `[TOOL_CALLS]name[ARGS]{...}` a call."""
    call = calls.each(lambda i: f"{text(calls.names[i])} {calls.marker(ARGS)} {calls.arguments(i)}")
    return f'start: call{"+" if parallel else ""}\ncall: {calls.marker(MARKER)} {call}'


def forced_with_ids(calls: OfferedCalls, parallel: bool) -> str:
    """Mistral Small 3.2: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` a call, the id 9 letters or digits."""
    call = calls.each(lambda i: f"{text(calls.names[i])} {calls.marker(CALL_ID)} /[A-Za-z0-9]{{9}}/ "
                                f"{calls.marker(ARGS)} {calls.arguments(i)}")
    return f'start: call{"+" if parallel else ""}\ncall: {calls.marker(MARKER)} {call}'


FORMAT = ToolFormat(
    name="mistral",
    parse=parse,
    stream=lambda names: HeldCallStream(names, split, parse),
    history=history,
    keeps_special_tokens=True,
    forced=forced_list,
)
# the same replies read alike; a forced reply is written as each template writes its calls
NAMED = dataclasses.replace(FORMAT, forced=forced_named)
WITH_IDS = dataclasses.replace(FORMAT, forced=forced_with_ids)
