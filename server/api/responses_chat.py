"""The chat completion a Responses request amounts to: its conversation as chat messages, its tools, its
text format and its reasoning effort."""
from __future__ import annotations

from pydantic import ValidationError

from ..errors import InvalidRequest
from .responses_schemas import NamedFunction, ResponseRequest
from .schemas import ChatCompletionRequest


def reasoning_text(item: dict) -> str:
    """A reasoning item's text: its reasoning, or else its summary."""
    parts = item.get("content") or item.get("summary") or []
    return "\n\n".join(p["text"] for p in parts)


def effort(body: ResponseRequest, thinks: bool) -> str | None:
    """reasoning.effort, which the chat's rendering makes the template's variable (chat_template.py): unset,
    the template's default. An effort for a model that does not think is refused, as OpenAI refuses it for
    its models that do not."""
    effort = body.reasoning.effort if body.reasoning is not None else None
    if effort not in (None, "none") and not thinks:
        raise InvalidRequest("'reasoning' is not supported with this model: its chat template has no thinking "
                             "(reasoning.effort)", param="reasoning.effort")
    return effort


def _messages(body: ResponseRequest, conversation: list[dict]) -> list[dict]:
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    thought = ""  # a reasoning item's text: the reasoning of the assistant turn that follows it

    def reply(message: dict) -> dict:
        nonlocal thought
        message, thought = ({**message, "reasoning_content": thought} if thought else message), ""
        return message

    for item in conversation:
        if item["type"] == "reasoning":
            thought = "\n\n".join(t for t in (thought, reasoning_text(item)) if t)
        elif item["type"] == "message":
            message = {"role": item["role"], "content": "".join(p["text"] for p in item["content"])}
            messages.append(reply(message) if item["role"] == "assistant" else message)
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant" and not thought:  # calls join the reply's text they came with
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append(reply({"role": "assistant", "content": None, "tool_calls": [call]}))
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_request(body: ResponseRequest, conversation: list[dict], thinks: bool) -> ChatCompletionRequest:
    """The chat completion the request amounts to: the conversation as messages, its tools and its format."""
    messages = _messages(body, conversation)
    fmt = body.text.format if body.text is not None and body.text.format is not None else None
    fmt = None if fmt is None or fmt.type == "text" else fmt
    choice = body.tool_choice
    if fmt is not None and body.tools and choice not in (None, "auto", "none"):
        raise InvalidRequest("a forced tool_choice and a text.format other than text cannot both constrain the output",
                             param="text.format")
    response_format = None if fmt is None else {"type": fmt.type}
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidRequest("text.format json_schema needs a schema", param="text.format.schema")
        response_format["json_schema"] = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    functions = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                 for t in body.tools or []]
    if isinstance(choice, NamedFunction):
        choice = {"type": "function", "function": {"name": choice.name}}
    try:
        return ChatCompletionRequest(messages=messages, tools=functions or None, tool_choice=choice,
                                     parallel_tool_calls=body.parallel_tool_calls, response_format=response_format,
                                     temperature=body.temperature, top_p=body.top_p,
                                     reasoning_effort=effort(body, thinks))
    except ValidationError as e:
        raise InvalidRequest(f"the conversation is not a valid chat: {e.errors()[0]['msg']}", param="input") from None
