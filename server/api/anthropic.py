"""Anthropic's Messages API: /v1/messages and /v1/messages/count_tokens.

A thin adapter over the chat path of the OpenAI routes: the request becomes the OpenAI-shaped chat it
means (system first; a tool_use block an assistant's tool call; a tool_result block a tool message),
which tools.py renders and the chat template turns into the prompt. `tool_choice` any or a named tool
is enforced by the same tool-call grammar, and the reply's calls are parsed (or streamed) by the same
code. A final assistant message is a prefill: the reply continues it.

`thinking` switches the template's thinking on or off (Qwen3's enable_thinking; off when absent, as Claude
does not think unless asked), and a reply's think block comes back as a thinking block before its text.
An earlier turn's thinking blocks go back into the chat as that turn's reasoning. gpt-oss always reasons: its
effort is output_config.effort, or else the thinking budget's size (under 4096 tokens low, under 16384
medium, else high), and its reasoning is a thinking block only where thinking was asked for.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from ..engine.constraints import Grammars
from ..engine.forced_calls import Layout
from ..engine.sampling import SamplingParams
from ..engine.sequence import Scheduling, Sequence
from ..errors import InvalidRequest
from . import anthropic_checks, chat_render, chat_template, generation, tools
from .anthropic_schemas import (ERROR_RESPONSES, CountTokensRequest, MediaBlock, Message, MessagesRequest,
                                RedactedThinkingBlock, TextBlock, ThinkingBlock, ToolResultBlock, ToolUseBlock)
from .anthropic_stream import MessageStream, ending, message, signature, tool_use_id, usage
from .anthropic_stream import error_body  # noqa: F401  (app.py renders errors under PREFIX with it)
from .reply import ReplyReader
from .schemas import ChatCompletionRequest

PREFIX = "/v1/messages"
router = APIRouter(tags=["anthropic"], responses=ERROR_RESPONSES)


def owns(path: str) -> bool:
    """Whether errors on this path take Anthropic's shape."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def _text_part(b: TextBlock | MediaBlock, at: str) -> dict:
    """A text block as an OpenAI content part; an image or a document is refused."""
    if isinstance(b, MediaBlock):
        raise InvalidRequest(f"{b.type} inputs are not supported: this server serves a text-only model", param=at)
    return {"type": "text", "text": b.text}


def _parts(blocks: list[TextBlock | MediaBlock], where: str) -> list[dict]:
    return [_text_part(b, f"{where}.{j}") for j, b in enumerate(blocks)]


def _chat_messages(m: Message, where: str) -> list[dict]:
    """One Anthropic message as OpenAI chat messages: a user's tool results each become a tool message."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out, text, calls, thought = [], [], [], []
    for j, b in enumerate(m.content):
        at = f"{where}.content.{j}"
        if isinstance(b, TextBlock | MediaBlock):
            text.append(_text_part(b, at))
        elif isinstance(b, ThinkingBlock | RedactedThinkingBlock):
            if m.role != "assistant":
                raise InvalidRequest(f"{b.type} blocks belong in assistant messages", param=at)
            thought += [b.thinking] if isinstance(b, ThinkingBlock) and b.thinking else []
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                raise InvalidRequest("tool_use blocks belong in assistant messages", param=at)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        else:
            if m.role != "user":
                raise InvalidRequest("tool_result blocks belong in user messages", param=at)
            if text:  # text before a result keeps its place
                out.append({"role": "user", "content": text})
                text = []
            out.append(_tool_message(b, at))
    if text or calls or not out:
        out.append({"role": m.role, "content": text or (None if calls else []), **({"tool_calls": calls} if calls else {}),
                    **({"reasoning_content": "\n\n".join(thought)} if thought else {})})
    return out


def _tool_message(b: ToolResultBlock, where: str) -> dict:
    parts = [] if isinstance(b.content, str) else _parts(b.content or [], f"{where}.content")
    content = b.content if isinstance(b.content, str) else "".join(p["text"] for p in parts)
    return {"role": "tool", "tool_call_id": b.tool_use_id, "content": f"error: {content}" if b.is_error else content}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The OpenAI-shaped chat this request means."""
    messages = []
    if body.system:
        system = body.system if isinstance(body.system, str) else _parts(body.system, "system")
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        messages += _chat_messages(m, f"messages.{i}")
    choice, named = body.tool_choice, None
    if choice is not None:
        named = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
    functions = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.input_schema}} for t in body.tools or []]
    try:
        return ChatCompletionRequest.model_validate({
            "messages": messages, "tools": functions or None, "tool_choice": named,
            "parallel_tool_calls": not (choice is not None and choice.disable_parallel_tool_use),
            "chat_template_kwargs": {"enable_thinking": body.thinking is not None and body.thinking.on},
        })
    except ValidationError as e:  # e.g. more messages than a chat holds, once tool results are split out
        raise InvalidRequest(f"the messages do not make a chat: {e.errors()[0]['msg']}", param="messages") from None


def render(http: HttpRequest, body: CountTokensRequest) -> tuple[ChatCompletionRequest, chat_render.RenderedChat]:
    """The request's chat and its prompt, through the chat template as for /v1/chat/completions."""
    generation.check_model(http, body.model)
    anthropic_checks.check_tools(body.tools or [])
    anthropic_checks.check_turns(body.messages)
    tok = generation.engine_of(http).tokenizer
    if body.thinking is not None and body.thinking.type == "enabled" and not chat_template.thinks(tok):
        raise InvalidRequest("thinking is not supported: this model's chat template has no thinking", param="thinking")
    if body.thinking is not None and body.thinking.on and body.tool_choice is not None and body.tool_choice.type in (
            "any", "tool"):  # Anthropic's rule: a forced call leaves no room to think first
        raise InvalidRequest("Thinking may not be enabled when tool_choice forces tool use.", param="tool_choice")
    chat = chat_request(body)
    effort = _effort(body)
    if effort is not None and chat_template.EFFORT in (tok.meta.chat_template or ""):
        chat = chat.model_copy(update={"reasoning_effort": effort})
    return chat, chat_render.render_chat(tok, chat, prefill=True)


def _effort(body: CountTokensRequest) -> str | None:
    config = getattr(body, "output_config", None)
    if config is not None and config.effort is not None:
        return config.effort
    budget = body.thinking.budget_tokens if body.thinking is not None else None
    return None if budget is None else "low" if budget < 4096 else "medium" if budget < 16384 else "high"


def _grammar(grammars: Grammars, forced: list[dict] | None, parallel: bool, output: tuple | None,
             layout: Layout) -> str | None:
    if forced is not None:
        return grammars.check(grammars.tool_calls(forced, parallel, layout), "tool_choice")
    return None if output is None else grammars.check(grammars.json_schema(*output), output[1])


async def _start(http: HttpRequest, body: MessagesRequest, prompt: list[int], forced: list[dict] | None,
           parallel: bool, reader: ReplyReader) -> Sequence:
    engine = generation.engine_of(http)
    output = body.output_schema()
    if forced is not None and output is not None:
        raise InvalidRequest("a forced tool_choice and a structured output format cannot both constrain the reply",
                             param=output[1])
    grammar = await asyncio.to_thread(_grammar, engine.grammars, forced, parallel, output,  # compiles: off the loop
                                      reader.format.forced)
    stop = tuple(body.stop_sequences or ())
    generation.check_stops(http, stop, "stop_sequences", "stop sequences")
    params = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_k=body.top_k or 0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        stop=stop,
        grammar=grammar,
    )
    params = reader.sampling(params)
    return generation.start(http, generation.session_id_of(http, body.session_id), prompt, params,
                            resend=True, scheduling=Scheduling(body.priority, body.timeout, body.speculative))[0]


def _tool_use(call: dict) -> dict:
    return {"type": "tool_use", "id": tool_use_id(), "name": call["function"]["name"],
            "input": json.loads(call["function"]["arguments"])}


def _thinking(body: MessagesRequest, reasoning: str | None) -> list[dict]:
    """The reply's thinking as a block, where the request asked for thinking and the reply did think."""
    if reasoning is None or body.thinking is None or not body.thinking.on:
        return []
    shown = "" if body.thinking.display == "omitted" else reasoning
    return [{"type": "thinking", "thinking": shown, "signature": signature(reasoning)}]


@router.post(PREFIX)
async def messages(body: MessagesRequest, http: HttpRequest):
    chat, rendered = render(http, body)
    forced = tools.forced_tools(chat)
    reader = rendered.reader if forced is None and body.output_schema() is None else rendered.reader.constrained()
    req = await _start(http, body, rendered.ids, forced, tools.parallel_calls(chat), reader)
    if body.stream:
        stream = MessageStream(http, req, reader, body.thinking)
        return StreamingResponse(stream.__aiter__(), media_type="text/event-stream", headers=generation.SSE_HEADERS)
    _, f = await generation.collect(http, req)
    reply = reader.parse([f.output])
    text, calls = reply.content, reply.calls
    content = _thinking(body, reply.reasoning) + ([{"type": "text", "text": text}] if text else [])
    content += [_tool_use(c) for c in calls]
    reason, stop = ending(generation.engine_of(http).tokenizer, req, f, len(calls), reader)
    return message(http, content, reason, stop, usage(f.prompt_tokens, f.cached_tokens, f.completion_tokens))


@router.post(PREFIX + "/count_tokens")
async def count_tokens(body: CountTokensRequest, http: HttpRequest) -> dict:
    _, rendered = render(http, body)
    return {"input_tokens": len(rendered.ids)}
