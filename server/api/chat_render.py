"""A chat through the model's chat template: the prompt's ids, and how to read the reply to it.

The template decides the rest: the tool-call format its model writes (tool_formats/), in which earlier calls
go back into the chat too, and whether it thinks, and if so whether the prompt leaves the reply inside a
think block (a template that ends its generation prompt with `<think>`).
"""
from __future__ import annotations

from dataclasses import dataclass

from models.tokenizer import TextTokenizer

from . import chat_template, tool_formats, tools
from .chat_messages import chat_messages
from .reasoning import opens_thought
from .reply import ReplyReader
from .schemas import ChatCompletionRequest
from .tokenize_schemas import TokenizeRequest


@dataclass(frozen=True)
class RenderedChat:
    ids: list[int]
    reader: ReplyReader


def render_chat(tok: TextTokenizer, body: ChatCompletionRequest | TokenizeRequest, add_special: bool = False,
                prefill: bool = False) -> RenderedChat:
    """`prefill`: a final assistant message is the start of the reply, which continues it (Anthropic's)."""
    fmt = tool_formats.format_for(tok.meta.chat_template)
    messages, template_tools = chat_messages(body, tok.template_has_tools, fmt.history)
    start = messages.pop()["content"] if prefill and messages[-1]["role"] == "assistant" else ""
    # the request's own template variables win over those its reasoning effort makes
    variables = {**(chat_template.effort_variables(tok, body.reasoning_effort, "reasoning_effort") or {}),
                 **(body.chat_template_kwargs or {})}
    text = chat_template.render(tok, messages, body.add_generation_prompt, template_tools, variables or None) + start
    forced = tools.offers_tools(body) and body.tool_choice not in (None, "auto")
    thinks = chat_template.thinks(tok)
    reader = ReplyReader(thinks=thinks, opened=thinks and opens_thought(text), names=tools.offered_functions(body),
                         forced=forced, format=fmt)
    return RenderedChat(tok.encode(text, add_special=add_special), reader)


def prompt_reader(tok: TextTokenizer, prompt: str) -> ReplyReader:
    """How to read the reply to a prompt rendered without tools (Ollama's /api/generate)."""
    thinks = chat_template.thinks(tok)
    return ReplyReader(thinks=thinks, opened=thinks and opens_thought(prompt),
                       format=tool_formats.format_for(tok.meta.chat_template))
