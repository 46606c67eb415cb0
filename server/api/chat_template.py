"""The model's chat template: whether it thinks, and rendering a chat through it with a request's own
template variables (vLLM's `chat_template_kwargs`, such as Qwen3's `enable_thinking`).

models.tokenizer.TextTokenizer renders its meta's `extra` as template variables besides the messages; a
request's variables make a tokenizer whose `extra` holds them too, kept for the next request that sends the
same ones (there are few: usually enable_thinking true or false).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any

from jinja2.defaults import DEFAULT_NAMESPACE

from models.tokenizer import ChatTemplateError, TextTokenizer

from ..errors import InvalidRequest
from .reasoning import OPEN

# what the server itself gives the template, and Jinja's own globals (namespace, range, ...; the tokenizer's
# raise_exception): a request's variables may not replace them, or the template would break
SERVER_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                              "raise_exception", *DEFAULT_NAMESPACE})


def thinks(tok: TextTokenizer) -> bool:
    """Whether the template knows thinking: a switch for it (Qwen3's enable_thinking) or think blocks."""
    template = tok.meta.chat_template or ""
    return "enable_thinking" in template or OPEN in template


def render(tok: TextTokenizer, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None,
           variables: dict[str, Any] | None = None) -> str:
    """The chat as the template writes it; its own errors (on roles and their order, say) are the client's."""
    if variables:
        taken = sorted(set(variables) & (SERVER_VARIABLES | set(tok.meta.extra)))
        if taken:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(map(repr, taken))}: the server sets "
                                 "it", param="chat_template_kwargs")
        tok = _with_variables(tok, json.dumps(variables, sort_keys=True))
    try:
        return tok.apply_chat_template(messages, add_generation_prompt, tools)
    except ChatTemplateError as e:
        raise InvalidRequest(str(e), param="messages") from None


@functools.lru_cache(maxsize=32)
def _with_variables(tok: TextTokenizer, variables: str) -> TextTokenizer:
    extra = {**tok.meta.extra, **json.loads(variables)}
    return TextTokenizer(tok.tokenizer, dataclasses.replace(tok.meta, extra=extra))
