"""Request bodies of the HTTP API (TGI-compatible and OpenAI-compatible), validated by pydantic."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_TOKENS_LIMIT = 1 << 20
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]  # within the caller's tenant, lower goes first
Timeout = Annotated[float, Field(gt=0.0, le=7 * 86400.0)]  # seconds from arrival; queued past it: 408; running: ends
StopList = Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=64)]


# Fields that only annotate a request: accepted and ignored.
ANNOTATION_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Fields other servers honour that would change the output and kvserve does not implement: refused by name.
UNSUPPORTED_FIELDS = frozenset({
    "best_of", "suffix", "functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
    "reasoning_effort", "use_beam_search", "length_penalty", "guided_whitespace_pattern", "structural_tag",
})


class _Body(BaseModel):
    """A request body: a field it does not know is refused (400, named), unless it only annotates or is null."""

    model_config = ConfigDict(extra="allow", str_max_length=4 * 2**20)

    @model_validator(mode="after")
    def _honest(self):
        for name, value in (self.model_extra or {}).items():
            if value is None or name in ANNOTATION_FIELDS:
                continue
            why = "is not supported" if name in UNSUPPORTED_FIELDS else "is not a known field"
            raise ValueError(f"'{name}' {why}: kvserve refuses fields that would change the output and that it does not implement")
        return self


class TGIGrammar(_Body):
    """TGI's `grammar` parameter: a JSON schema or a regex the output must match."""

    type: Literal["json", "json_object", "regex"]
    value: Any


class GenerateParameters(_Body):
    """TGI `parameters`."""

    max_new_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    stop: StopList = []
    do_sample: bool = False
    details: bool = False
    decoder_input_details: bool = False
    return_full_text: bool | None = False
    top_n_tokens: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    truncate: Annotated[int, Field(gt=0)] | None = None  # keep only the last `truncate` tokens of the input
    typical_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    watermark: bool = False
    grammar: TGIGrammar | None = None
    priority: Priority = 0
    timeout: Timeout | None = None

    @model_validator(mode="after")
    def _unimplemented(self):
        for name, off in (("typical_p", self.typical_p in (None, 1.0)), ("watermark", not self.watermark),
                          ("decoder_input_details", not self.decoder_input_details)):
            if not off:
                raise ValueError(f"'{name}' is not supported")
        return self


class GenerateRequest(_Body):
    """TGI `/generate` and `/generate_stream` body (plus an optional session)."""

    inputs: str
    parameters: GenerateParameters = GenerateParameters()
    stream: bool = False
    session_id: str | None = None


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: Annotated[str, Field(min_length=1, max_length=256)] | StopList | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    session_id: str | None = None
    priority: Priority = 0
    timeout: Timeout | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)] | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions: the output matches a JSON schema, a regex, a Lark or GBNF grammar, or one of some strings
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    regex: str | None = None
    guided_grammar: str | None = None
    grammar: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=256)] | None = None


class CompletionRequest(_OpenAISampling):
    """OpenAI `/v1/completions` body."""

    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    def text(self) -> str:
        content = self.content
        return "".join(p.text for p in content) if isinstance(content, list) else content or ""


class ChatCompletionRequest(_OpenAISampling):
    """OpenAI `/v1/chat/completions` body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class SessionCreate(_Body):
    """`POST /v1/sessions` body."""

    capacity: Annotated[int, Field(gt=0)] | None = None
    sizing: Literal["static", "dynamic"] | None = None
    id: Annotated[str, Field(min_length=22, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")] | None = None


class SessionFork(_Body):
    """`POST /v1/sessions/{id}/fork` body: the new session's id, if the client picks it."""

    id: Annotated[str, Field(min_length=22, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")] | None = None


class SessionRewind(_Body):
    length: Annotated[int, Field(ge=0)]


class TokenizeRequest(_Body):
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Body):
    tokens: Annotated[list[int], Field(max_length=1 << 20)]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    """Every error the API returns."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in [(400, "Invalid request"), (401, "Missing or wrong API key"), (404, "Not found"),
                       (408, "Deadline passed while queued"),
                       (409, "Session busy"), (413, "Body too large"), (429, "Server full"),
                       (500, "A model step failed"), (503, "Shutting down")]
}
