"""A Responses request's input as conversation items: the shapes OpenAI stores and lists them in, and the
rule that ties them together (a function call's output answers a call the conversation holds)."""
from __future__ import annotations

from ..errors import InvalidRequest
from .responses_schemas import MediaPart
from .responses_stream import call_item, new_id


def input_items(value: str | list) -> list[dict]:
    """The request's input as stored items, the shapes OpenAI lists them in."""
    if isinstance(value, str):
        return [{"id": new_id("msg_"), "type": "message", "status": "completed", "role": "user",
                 "content": [{"type": "input_text", "text": value}]}]
    out = []
    for item in value:
        if item.type == "message":
            kind = "output_text" if item.role == "assistant" else "input_text"
            content = [{"type": kind, "text": item.content}] if isinstance(item.content, str) else item.content
            parts = [p if isinstance(p, dict) else _part(p) for p in content]
            out.append({"id": item.id or new_id("msg_"), "type": "message", "status": "completed", "role": item.role,
                        "content": parts})
        elif item.type == "function_call":
            out.append(call_item(item.call_id, item.name, item.arguments, item_id=item.id))
        elif item.type == "reasoning":
            out.append({"id": item.id or new_id("rs_"), "type": "reasoning", "status": "completed",
                        "summary": [p.model_dump() for p in item.summary],
                        "content": [p.model_dump() for p in item.content or []]})
        else:
            output = item.output if isinstance(item.output, str) else "".join(_part(p)["text"] for p in item.output)
            out.append({"id": item.id or new_id("fco_"), "type": "function_call_output", "status": "completed",
                        "call_id": item.call_id, "output": output})
    return out


def _part(part) -> dict:
    if isinstance(part, MediaPart):
        what = {"input_image": "image", "input_file": "file", "input_audio": "audio"}[part.type]
        raise InvalidRequest(f"{what} inputs are not supported", param="input")
    return {"type": part.type, "text": part.text, **({"annotations": []} if part.type == "output_text" else {})}


def check_call_outputs(history: list[dict], turn: list[dict]) -> None:
    """Each function_call_output of this turn answers a function_call before it, in the turn or in the
    previous response's conversation: one that answers nothing is refused, as OpenAI refuses it (the
    model would read a result of a call it never made)."""
    calls = {item["call_id"] for item in history if item["type"] == "function_call"}
    for item in turn:
        if item["type"] == "function_call":
            calls.add(item["call_id"])
        elif item["type"] == "function_call_output" and item["call_id"] not in calls:
            raise InvalidRequest(f"No tool call found for function call output with call_id {item['call_id']}.",
                                 param="input")
