"""Request bodies of OpenAI's Responses API (`POST /v1/responses`), validated by pydantic.

Items a client sends back as they came out (`input=previous.output + [...]`) carry output fields such as
`id`, `status` and `annotations`: those are accepted and ignored, as they do not change the output.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from .schemas import MAX_TOKENS_LIMIT, _Body

FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class TextPart(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MediaPart(BaseModel):
    """An image or a file: recognised so that the refusal can name it (the route refuses it)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["input_image", "input_file", "input_audio"]


Part = Annotated[Union[TextPart, MediaPart], Field(discriminator="type")]


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: str | list[Part]
    id: str | None = None
    status: str | None = None


class ReasoningText(_Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Body):
    """An earlier reply's reasoning, sent back as it came: its text goes back into the chat as that reply's
    reasoning (encrypted content, which only OpenAI can read, is dropped)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str | None:
    """An item without a `type` is a message (OpenAI's EasyInputMessage)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


Item = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[ReasoningItem, Tag("reasoning")]],
    Discriminator(_item_type),
]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FunctionTool(_Body):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Body):
    format: TextFormat | None = None


class ReasoningConfig(_Body):
    """effort "none": the template's thinking off (Qwen3's enable_thinking); another effort: on (not graded:
    a model thinks or not); unset: the template's default. A summary asked for is the reasoning itself, whole:
    kvserve does not summarise."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # summary's older name


# Every value OpenAI documents for `include`: each only adds fields to items of its kind, so each is taken,
# and adds output only where kvserve makes such items (the output text's logprobs); the OpenAI Agents SDK
# always sends the field.
Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]


class ResponseRequest(_Body):
    """`POST /v1/responses` body."""

    model: str | None = None
    input: str | Annotated[list[Item], Field(min_length=1, max_length=4096)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" would drop history to fit: not implemented
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: Annotated[list[Includable], Field(max_length=64)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None  # with include's logprobs: the runners-up a token
    reasoning: ReasoningConfig | None = None

    @property
    def logprobs(self) -> int | None:
        """The runners-up to score for each output token, or None where the output's logprobs are not asked for."""
        return (self.top_logprobs or 0) if "message.output_text.logprobs" in (self.include or ()) else None

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items: Any) -> Any:
        if isinstance(items, list):
            for i, item in enumerate(items):
                kind = _item_type(item)
                if kind not in ITEM_TYPES:
                    raise ValueError(f"input[{i}] is an item of type {kind!r}, which kvserve does not take (it takes "
                                     f"{', '.join(ITEM_TYPES)} items)")
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        if isinstance(tools, list):
            other = sorted({str(t.get("type")) for t in tools if isinstance(t, dict) and t.get("type") != "function"})
            if other:
                raise ValueError(f"tools of type {', '.join(map(repr, other))} are not supported: kvserve runs "
                                 "function tools only")
        return tools
