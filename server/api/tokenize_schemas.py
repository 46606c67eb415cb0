"""Bodies of /tokenize and /detokenize, as vLLM and llama-server shape them."""
from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from .schemas import ChatMessage, Effort, NamedToolChoice, TemplateVariables, Tool, _Body


class _UtilityBody(_Body):
    """A body of a route that generates nothing: an unknown field is refused as not one of its own."""

    route: ClassVar[str] = ""

    @classmethod
    def _refusal(cls, name: str) -> str:
        return f"'{name}' is not a field of {cls.route} (it takes {', '.join(cls.model_fields)})"


class TokenizeRequest(_UtilityBody):
    """`/tokenize` as vLLM (`prompt`, or chat `messages`) and llama-server (`content`) take it."""

    route: ClassVar[str] = "/tokenize"
    model: str | None = None
    prompt: str | None = None
    content: str | None = None  # llama-server's name for the prompt
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # "none" renders no tools
    chat_template_kwargs: TemplateVariables | None = None  # as the chat route takes them
    reasoning_effort: Effort | None = None  # as the chat route takes it
    # None: the prompt gets the model's special tokens (vLLM), llama-server's content and chat messages not
    add_special_tokens: bool | None = None
    add_special: bool | None = None  # llama-server's name
    return_token_strs: bool = False  # vLLM: the vocabulary's string for each token
    with_pieces: bool = False  # llama-server: tokens as {"id", "piece"}


class DetokenizeRequest(_UtilityBody):
    route: ClassVar[str] = "/detokenize"
    model: str | None = None
    tokens: Annotated[list[int], Field(max_length=1 << 20)]
