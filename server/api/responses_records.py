"""What a stored response's session keeps in its `meta`, checked field by field when it is read back.

On the disk tier that meta is part of a session's record, a file that anyone who may write in the
folder can edit, and the disk tier checks only the session's own fields (kvcache/disk_records.py).
So the Responses routes read a meta only once it holds every field they use, of the type they use it
as; any other is no stored response (a 404), never a crash halfway through a request.
"""
from __future__ import annotations

_ROLES = ("user", "system", "developer", "assistant")
_FIELDS = {"function_call": ("call_id", "name", "arguments"), "function_call_output": ("call_id", "output")}


def is_stored_response(meta: object, response_id: str) -> bool:
    """Whether `meta` is what `_Run.store` (server/api/responses.py) writes for this response: the response
    object, the conversation as items, and this turn's input as a [start, end) span of them."""
    if not isinstance(meta, dict):
        return False
    response, conversation, span = meta.get("response"), meta.get("conversation"), meta.get("input")
    return (isinstance(response, dict) and response.get("id") == response_id
            and isinstance(conversation, list) and all(_is_item(item) for item in conversation)
            and isinstance(span, list) and len(span) == 2 and all(type(n) is int for n in span)
            and 0 <= span[0] <= span[1] <= len(conversation))


def _is_item(item: object) -> bool:
    """An item as the routes read it: chat_request renders it, input_items lists it by id."""
    if not isinstance(item, dict) or not isinstance(item.get("id"), str):
        return False
    kind = item.get("type")
    if kind == "message":
        return item.get("role") in _ROLES and _texts(item.get("content"))
    if kind == "reasoning":
        return _texts(item.get("content")) and _texts(item.get("summary"))
    return kind in _FIELDS and all(isinstance(item.get(name), str) for name in _FIELDS[kind])


def _texts(parts: object) -> bool:
    return isinstance(parts, list) and all(isinstance(part, dict) and isinstance(part.get("text"), str) for part in parts)
