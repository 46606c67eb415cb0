"""Tool calling in the Hermes format: tools described to the model, calls rendered into the prompt and
parsed out of its text as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks.

A chat template that knows tools (it names `tools`) renders them itself; one that does not (SmolLM2's)
gets them described in the system message, in this format. Which tools are offered and forced is read here
for every format; a template's own format (tool_formats/) writes earlier calls back its own way.
`tool_choice` "required" or a named function is enforced by a grammar that writes the calls in the model's
format (engine/forced_calls.py), so the arguments always parse and match their schema.
"""
from __future__ import annotations

import json
import secrets
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

from ..errors import InvalidRequest
from .schemas import ChatCompletionRequest, ChatMessage

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
TOOLS_PROMPT = (
    "You can call functions. They are described, one JSON object each, between <tools> and </tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, reply with <tool_call>\n{{\"name\": <function name>, \"arguments\": <arguments as JSON>}}\n"
    "</tool_call> for each call. A function's result comes back in a tool message."
)


def offers_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) and body.tool_choice != "none"


def offered_functions(body: ChatCompletionRequest) -> dict[str, dict]:
    """The functions a reply may call, each one's parameters schema by its name (none where tools are not offered)."""
    return {t.function.name: t.function.parameters for t in body.tools} if offers_tools(body) else {}


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
    calls, blocks = [], call_blocks(text)
    for _, _, body_start, body_end in blocks:
        try:
            call = json.loads(text[body_start:body_end])
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") in names:
            arguments = json.dumps(call.get("arguments", {}), ensure_ascii=False)
            calls.append({"id": "call_" + secrets.token_hex(12), "type": "function",
                          "function": {"name": call["name"], "arguments": arguments}})
    if forced:
        return None, calls
    content = _without(text, blocks) if calls else text
    cut = content.rfind(OPEN_TAG)
    if cut >= 0 and "</tool_call>" not in content[cut:]:
        content = content[:cut]  # a call the reply ended inside
    content = content.strip() if calls else content
    return content or None, calls


def call_blocks(text: str) -> list[tuple[int, int, int, int]]:
    """The `<tool_call>{...}</tool_call>` blocks of `text`, as (start, end, the braces' start, their end): what
    the regex `<tool_call>\\s*(\\{.*?\\})\\s*</tool_call>` finds (the first '}' after the '{' that only whitespace
    parts from a closing tag), scanned in linear time: that regex goes over the rest of the text again for
    every opening tag with no close after it."""
    # the '}' before each closing tag, where only whitespace stands between them; rising with the tags
    braces, ends, at = [], [], 0
    while (close := text.find(CLOSE_TAG, at)) >= 0:
        last = close - 1
        while last >= 0 and text[last].isspace():
            last -= 1
        if last >= 0 and text[last] == "}":
            braces.append(last)
            ends.append(close + len(CLOSE_TAG))
        at = close + len(CLOSE_TAG)
    blocks, at = [], 0
    while (start := text.find(OPEN_TAG, at)) >= 0:
        brace = start + len(OPEN_TAG)
        while brace < len(text) and text[brace].isspace():
            brace += 1
        k = bisect_right(braces, brace) if brace < len(text) and text[brace] == "{" else len(braces)
        if k == len(braces):
            at = start + 1
            continue
        blocks.append((start, ends[k], brace, braces[k] + 1))
        at = ends[k]
    return blocks


def _without(text: str, blocks: list[tuple[int, int, int, int]]) -> str:
    pieces, at = [], 0
    for start, end, _, _ in blocks:
        pieces.append(text[at:start])
        at = end
    return "".join(pieces) + text[at:]
