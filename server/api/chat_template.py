"""The model's chat template: whether it thinks, and rendering a chat through it with a request's own
template variables (vLLM's `chat_template_kwargs`, such as Qwen3's `enable_thinking`).

models.tokenizer.TextTokenizer renders its meta's `extra` as template variables besides the messages; a
request's variables make a tokenizer whose `extra` holds them too, kept for the next request that sends the
same ones (there are few: usually enable_thinking true or false). A request's reasoning effort becomes the
variable the template reads: gpt-oss's reasoning_effort, or a thinking switch.
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
                              "raise_exception", "strftime_now", *DEFAULT_NAMESPACE})
EFFORT = "reasoning_effort"  # gpt-oss's variable: low, medium or high
EFFORTS = ("low", "medium", "high")


def thinks(tok: TextTokenizer) -> bool:
    """Whether the template knows thinking: a switch for it (Qwen3's enable_thinking) or think blocks."""
    template = tok.meta.chat_template or ""
    return "enable_thinking" in template or OPEN in template or EFFORT in template


def effort_variables(tok: TextTokenizer, effort: str | None, param: str) -> dict[str, Any] | None:
    """A request's reasoning effort as the template's variables (None: the template's default): gpt-oss's
    reasoning_effort ('none' and 'minimal' as low, its least: it always reasons; 'xhigh' as high), or else the thinking switch
    (Qwen3's enable_thinking: off at 'none'). A model that does not think refuses an effort, as OpenAI
    refuses it for its models that do not."""
    if effort is None:
        return None
    if EFFORT in (tok.meta.chat_template or ""):
        return {EFFORT: effort if effort in EFFORTS else "high" if effort == "xhigh" else "low"}
    if effort != "none" and not thinks(tok):
        raise InvalidRequest(f"'{param}' is not supported with this model: its chat template has no thinking", param=param)
    return {"enable_thinking": effort != "none"}


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

