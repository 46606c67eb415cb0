"""Request bodies of the HTTP API (TGI-compatible and OpenAI-compatible), validated by pydantic."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_TOKENS_LIMIT = 1 << 20
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1)]  # within the caller's tenant, lower goes first
Timeout = Annotated[float, Field(gt=0.0, le=7 * 86400.0)]  # seconds from arrival; queued past it: 408; running: ends
MAX_STOP_STRINGS = 64
MAX_PROMPTS = 256  # prompts in one /v1/completions request
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def _fail(kind: str, message: str):
    """One error with its own message: a union's members would otherwise each report why they failed."""
    raise PydanticCustomError(kind, message)


def _stop_count(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
        _fail("too_long", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(value)}")
    return value


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_shape(value: Any) -> Any:
    """A prompt is a string or token ids; a list of either is several prompts."""
    several = isinstance(value, list) and value and (all(isinstance(v, str) for v in value) or all(map(_ids, value)))
    if not (isinstance(value, str) or _ids(value) or several):
        _fail("prompt_type", "prompt must be a string, token ids, a list of strings, or a list of lists of token ids")
    if several and len(value) > MAX_PROMPTS:
        _fail("too_long", f"at most {MAX_PROMPTS} prompts are allowed in one request, got {len(value)}")
    empty = next((i for i, v in enumerate(value if several else ()) if not v), None)
    if not value or empty is not None:
        _fail("too_short", "prompt is empty" if empty is None else f"prompt {empty} of the list is empty")
    return value


StopList = Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=MAX_STOP_STRINGS)]
# vLLM's chat_template_kwargs: more variables for the chat template (Qwen3's enable_thinking, ...)
# OpenAI's reasoning effort: the template's reasoning_effort (gpt-oss's) or thinking switch (chat_template.py)
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
TemplateVariables = Annotated[dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], Any], Field(max_length=64)]


# Fields that only annotate a request: accepted and ignored.
ANNOTATION_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
# Fields other servers take, accepted at the value that changes nothing (vllm-router sends them so when it
# forwards a request: SGLang's and vLLM's defaults); any other value is refused like an unknown field.
NEUTRAL_FIELDS = {"no_stop_trim": False, "continue_final_message": False, "skip_special_tokens": True,
                  "separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False,
                  "include_reasoning": True}
# Fields other servers honour that would change the output and kvserve does not implement: refused by name.
UNSUPPORTED_FIELDS = frozenset({
    "best_of", "suffix", "functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
    "use_beam_search", "length_penalty", "guided_whitespace_pattern", "structural_tag",
})


class _Body(BaseModel):
    """A request body: a field it does not know is refused (400, named), unless it only annotates or is null."""

    model_config = ConfigDict(extra="allow", str_max_length=4 * 2**20)
    _neutral: ClassVar[dict] = {}  # fields accepted at a value that changes nothing (generation bodies only)

    @model_validator(mode="after")
    def _honest(self):
        for name, value in (self.model_extra or {}).items():
            if value is None or name in ANNOTATION_FIELDS or (name in self._neutral and value == self._neutral[name]):
                continue
            raise ValueError(self._refusal(name))
        return self

    @classmethod
    def _refusal(cls, name: str) -> str:
        why = "is not supported" if name in UNSUPPORTED_FIELDS else "is not a known field"
        return f"'{name}' {why}: kvserve refuses fields that would change the output and that it does not implement"


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
    speculative: bool | None = None  # draft tokens from its own history (None: the server's --speculative)

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
    _neutral: ClassVar[dict] = NEUTRAL_FIELDS
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
    stop: Annotated[Annotated[str, Field(min_length=1, max_length=256)] | StopList | None, BeforeValidator(_stop_count)] = None
    stop_token_ids: Annotated[list[int], Field(max_length=64)] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=16)] = 1
    session_id: str | None = None
    priority: Priority = 0
    timeout: Timeout | None = None
    speculative: bool | None = None  # draft tokens from its own history (None: the server's --speculative)
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # vLLM's prefix-cache namespace
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

    # one prompt (text or token ids) or several, each run with n choices
    prompt: Annotated[
        Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
        BeforeValidator(_prompt_shape)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False


class ContentPart(_Body):
    type: Literal["text"]
    text: str


def _text_parts(value: Any) -> Any:
    """Only text parts: an image or audio part gets its own error, not every union member's."""
    for part in value if isinstance(value, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            _fail("content_part", "each content part is an object with a 'type', such as {\"type\": \"text\", \"text\": ...}")
        if kind in IMAGE_PARTS:
            _fail("image_input", "image inputs are not supported: this server serves a text-only model")
        if kind != "text":
            _fail("content_part", f"content parts of type {kind!r} are not supported; only 'text' parts are")
    return value


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[ContentPart] | None, BeforeValidator(_text_parts)] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning_content: str | None = None  # an earlier reply's reasoning, as this server (and vLLM) returned it

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
    chat_template_kwargs: TemplateVariables | None = None
    reasoning_effort: Effort | None = None


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
