"""Request bodies of Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), validated by pydantic.

`cache_control` is accepted on the request, its blocks and tools, and ignored: the prefix cache reuses any prompt prefix
it holds, marked or not.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from . import schemas
from .schemas import MAX_TOKENS_LIMIT, Priority, StopList, Timeout, _Body

CacheControl = dict[str, Any] | None


TEXT_TYPES = ("text",)
RESULT_TYPES = ("text", "image", "document")  # what a tool_result's content holds
BLOCK_TYPES = (*RESULT_TYPES, "tool_use", "tool_result", "thinking", "redacted_thinking")


def known_blocks(value: Any, types: tuple[str, ...], where: str = "") -> Any:
    """Content as a string or a list of blocks of these types: anything else is refused by what it is (pydantic
    alone would first report the string the content is not)."""
    if isinstance(value, str) or value is None:
        return value
    if not isinstance(value, list):
        raise PydanticCustomError("content", "content is a string or a list of content blocks")
    for j, block in enumerate(value):
        kind, at = block.get("type") if isinstance(block, dict) else None, f"{where}{j}"
        if not isinstance(kind, str):
            raise PydanticCustomError("content_block", "content block {at} is not an object with a type", {"at": at})
        if kind not in types:
            raise PydanticCustomError("content_block_type", "content block {at} has type {kind}, which is not "
                                      "supported here (supported: {types})",
                                      {"at": at, "kind": repr(kind[:64]), "types": ", ".join(types)})
        if kind == "tool_result":
            known_blocks(block.get("content"), RESULT_TYPES, f"{at}.content.")
    return value


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None


class MediaBlock(_Body):
    """An image or a document: parsed so the refusal can name it (kvserve serves text-only models)."""

    type: Literal["image", "document"]
    source: dict[str, Any]
    cache_control: CacheControl = None


class ToolUseBlock(_Body):
    """An assistant's earlier call."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]
    cache_control: CacheControl = None


class ToolResultBlock(_Body):
    """The result of a call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[Annotated[Union[TextBlock, MediaBlock], Field(discriminator="type")]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None

    @field_validator("content", mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        return known_blocks(value, RESULT_TYPES)


class ThinkingBlock(_Body):
    """An assistant's earlier thinking, sent back as it came (its signature is not checked: kvserve does not sign)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: CacheControl = None


class RedactedThinkingBlock(_Body):
    """Thinking another server encrypted: nothing here can read it, so it is left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str
    cache_control: CacheControl = None


Block = Annotated[Union[TextBlock, MediaBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=4096)]

    @field_validator("content", mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        return known_blocks(value, BLOCK_TYPES)


class Tool(_Body):
    """A client tool: the model calls it, the client runs it and sends back a tool_result."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl = None


class ToolChoice(_Body):
    """auto: the model decides; any: it must call a tool; tool: it must call the named one; none: no tools."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self):
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("a tool_choice of type 'tool' names its tool, and only that type has a name")
        return self


class ThinkingConfig(_Body):
    """enabled: the reply thinks first, and its thinking comes back as thinking blocks; adaptive: the same,
    on a model that thinks; disabled: no thinking (the template's switch off). budget_tokens is checked as
    Anthropic checks it, and not enforced: the model's thinking ends when it closes it (max_tokens still bounds it)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks with empty text

    @model_validator(mode="after")
    def _budget(self):
        if (self.type == "enabled") != (self.budget_tokens is not None):
            raise ValueError("thinking.budget_tokens is required with type 'enabled', and only there")
        return self

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class CountTokensRequest(_Body):
    """`/v1/messages/count_tokens` body: what the prompt is made of."""

    model: str
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    cache_control: CacheControl = None
    thinking: ThinkingConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, value: Any) -> Any:
        return known_blocks(value, TEXT_TYPES)


class OutputFormat(_Body):
    """Structured output: the reply's text is JSON matching the schema."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high"] | None = None  # thinking effort: accepted, not graded (a model thinks or not)


class MessagesRequest(CountTokensRequest):
    """`/v1/messages` body (plus kvserve's session, priority and timeout)."""

    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_LIMIT)]
    stop_sequences: StopList | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    metadata: dict[str, Any] | None = None  # annotates only (user_id): ignored
    stream: bool = False
    session_id: str | None = None
    priority: Priority = 0
    timeout: Timeout | None = None
    speculative: bool | None = None
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the beta's name for output_config.format

    def output_schema(self) -> tuple[dict[str, Any], str] | None:
        """The JSON schema the reply must match, and where it was given, if any."""
        if self.output_config is not None and self.output_config.format is not None:
            return self.output_config.format.schema_, "output_config.format.schema"
        return (self.output_format.schema_, "output_format.schema") if self.output_format is not None else None

    @model_validator(mode="after")
    def _budget_fits(self):
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({budget}) must be less than max_tokens ({self.max_tokens})")
        return self


class ErrorDetail(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    """Every error under /v1/messages."""

    type: Literal["error"] = "error"
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {**doc, "model": ErrorResponse} for code, doc in schemas.ERROR_RESPONSES.items()
}
