"""A chat's messages as its template takes them: as the client sent them, the way transformers passes them,
where the template renders tools itself; with earlier calls and results as Hermes text where it does not
(its tools are then described in that format, tools.py)."""
from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from .schemas import ChatCompletionRequest, ChatMessage
from .tools import OPEN_TAG, TOOLS_PROMPT, offers_tools


def arguments_value(text: str) -> Any:
    """An earlier call's arguments as the template takes them: the object its JSON text holds."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def structured_message(m: ChatMessage, call_id: Callable[[str], str] = lambda i: i) -> dict[str, Any]:
    """A message for a template that renders tool calls and results itself: its calls as `tool_calls` with
    their arguments as objects, a tool result bare with the call it answers and its name, as transformers
    passes them (the key only where there are calls: Llama 3's template tests for it). A reply of calls
    alone, whose content clients send as null, has the empty text: Qwen3's and LFM2's templates read it."""
    out: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"id": call_id(c.id), "type": "function",
                              "function": {"name": c.function.name, "arguments": arguments_value(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.role == "tool" and m.tool_call_id:
        out["tool_call_id"] = call_id(m.tool_call_id)
    if m.name:  # a tool result's function, or a participant's name
        out["name"] = m.name
    if m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def chat_messages(body: ChatCompletionRequest, template_has_tools: bool,
                  history: Callable[[ChatMessage], dict[str, Any]] = structured_message) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template takes them, and the tools for a template that renders its own, in
    transformers' shape ({"type": "function", "function": ...}: Mistral's templates read `tool.function`).
    A template that renders tools writes earlier calls and results itself, each through `history` (the
    messages as sent, as transformers passes them; a format's own call ids); one that does not gets them
    as Hermes text, the format its tools are described in (plain_message)."""
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []] if offers_tools(body) else []
    out = [(history if template_has_tools else plain_message)(m) for m in _named_results(body.messages)]
    if tools and not template_has_tools:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + described
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, ([{"type": "function", "function": t} for t in tools] if tools and template_has_tools else None)


def plain_message(m: ChatMessage) -> dict[str, Any]:
    """A message for a template that knows no tools: earlier tool calls and tool results in the Hermes format
    its tools were described in, and an earlier reply's reasoning as `reasoning_content`."""
    content = m.text()
    for call in m.tool_calls or []:
        content += f"{OPEN_TAG}\n" + json.dumps({"name": call.function.name, "arguments": arguments_value(call.function.arguments)},
                                                ensure_ascii=False) + "\n</tool_call>\n"
    if m.role == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    out = {"role": "system" if m.role == "developer" else m.role, "content": content}
    return {**out, "reasoning_content": m.reasoning_content} if m.reasoning_content else out


def _named_results(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Tool results named by the function whose call they answer, where the client did not name them (OpenAI's
    and Anthropic's results carry only the call's id; templates such as gpt-oss's write the name)."""
    names, out = {}, []
    for m in messages:
        for c in m.tool_calls or ():
            names[c.id] = c.function.name
        if m.role == "tool" and m.name is None and m.tool_call_id in names:
            m = m.model_copy(update={"name": names[m.tool_call_id]})
        out.append(m)
    return out
