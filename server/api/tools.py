"""Tool calling in the Hermes format: tools described to the model, calls rendered into the prompt and
parsed out of its text as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

A chat template that knows tools (it names `tools`) renders them itself; one that does not (SmolLM2's)
gets them described in the system message, in this format. Which tools are offered and forced is read here
for every format; a template's own format (tool_formats/) may write earlier calls back its own way. `tool_choice` "required" or a named function is enforced
by a grammar (constraints.Grammars.tool_calls), so the arguments always parse and match their schema.
"""
from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from typing import Any

from ..errors import InvalidRequest
from .schemas import ChatCompletionRequest, ChatMessage

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
OPEN_TAG = "<tool_call>"
CALL_END = "</tool_call>\n"  # what ends each call of a forced reply (Grammars.tool_calls's layout)
TOOLS_PROMPT = (
    "You can call functions. They are described, one JSON object each, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, reply with <tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as JSON>}}\n"
    "</tool_call> for each call. A function's result comes back in a tool message."
)


def chat_messages(body: ChatCompletionRequest, template_has_tools: bool,
                  history: Callable[[ChatMessage], dict[str, Any]] | None = None) -> tuple[list[dict], list[dict] | None]:
    """The messages as the chat template takes them (each through `history`, the tool format's way of writing
    earlier calls and results; Hermes's by default), and the tools for a template that renders its own, in
    transformers' shape ({"type": "function", "function": ...}: Mistral's templates read `tool.function`)."""
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools or []] if offers_tools(body) else []
    out = [(history or plain_message)(m) for m in body.messages]
    if tools and not template_has_tools:
        described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + described
        else:
            out.insert(0, {"role": "system", "content": described})
    return out, ([{"type": "function", "function": t} for t in tools] if tools and template_has_tools else None)


def plain_message(m: ChatMessage) -> dict[str, Any]:
    """A message as the chat template takes it: earlier tool calls and tool results in the Hermes format, and
    an earlier reply's reasoning as `reasoning_content` (Qwen3's template writes the latest turns' back)."""
    content = m.text()
    for call in m.tool_calls or []:
        content += f"{OPEN_TAG}\n" + json.dumps({"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                                                ensure_ascii=False) + "\n</tool_call>\n"
    if m.role == "tool":
        content = f"<tool_response>\n{content}\n</tool_response>"
    out = {"role": "system" if m.role == "developer" else m.role, "content": content}
    return {**out, "reasoning_content": m.reasoning_content} if m.reasoning_content else out


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def offers_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def offered_names(body: ChatCompletionRequest) -> set[str]:
    """The functions a reply may call (none where tools are not offered)."""
    return {t.function.name for t in body.tools} if offers_tools(body) else set()


def forced_tools(body: ChatCompletionRequest) -> list[dict] | None:
    """The functions the output must call ("required": any of them; a named choice: that one), or None."""
    if not offers_tools(body) or body.tool_choice in (None, "auto"):
        if body.tool_choice not in (None, "auto", "none") and not body.tools:
            raise InvalidRequest("tool_choice needs tools", param="tool_choice")
        return None
    functions = [t.function.model_dump(exclude_none=True) for t in body.tools]
    if body.tool_choice == "required":
        return functions
    named = [f for f in functions if f["name"] == body.tool_choice.function.name]
    if not named:
        raise InvalidRequest(f"tool_choice names {body.tool_choice.function.name!r}, which is not among the tools",
                             param="tool_choice")
    return named


def parallel_calls(body: ChatCompletionRequest) -> bool:
    """Whether a forced reply may hold several calls: a named function is called once, as OpenAI and
    Anthropic do; "required" may call several unless parallel_tool_calls is off."""
    return body.parallel_tool_calls and body.tool_choice == "required"


def parse_tool_calls(text: str, names: set[str], forced: bool = False) -> tuple[str | None, list[dict]]:
    """Text -> (the content outside the calls, or None; the complete calls of known functions, OpenAI-shaped).
    A call cut short by max_tokens is dropped, never shown as content; a forced reply has no content. With no
    function offered, the whole text is content."""
    if not names:
        return text, []
    calls = []
    for match in TOOL_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in names:
            arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
            calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                          "function": {"name": call["name"], "arguments": arguments}})
    if forced:
        return None, calls
    content = TOOL_CALL.sub("", text) if calls else text
    cut = content.rfind(OPEN_TAG)
    if cut >= 0 and "</tool_call>" not in content[cut:]:
        content = content[:cut]  # a call the reply ended inside
    content = content.strip() if calls else content
    return content or None, calls
