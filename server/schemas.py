"""Request bodies of the HTTP API (TGI-compatible and OpenAI-compatible), validated by pydantic."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_TOKENS_LIMIT = 1 << 20
StopList = Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]], Field(max_length=64)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", str_max_length=4 * 2**20)


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
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False


class GenerateRequest(_Body):
    """TGI `/generate` and `/generate_stream` body (plus an optional session)."""

    inputs: str
    parameters: GenerateParameters = GenerateParameters()
    stream: bool = False
    session_id: str | None = None
    debug_fail_step: bool = False  # honoured only with --fault-injection


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
    user: str | None = None
    session_id: str | None = None
    debug_fail_step: bool = False


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

    def plain(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_OpenAISampling):
    """OpenAI `/v1/chat/completions` body."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[int, Field(ge=0, le=MAX_TOKENS_LIMIT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True


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
                       (409, "Session busy"), (413, "Body too large"), (429, "Server full"),
                       (500, "A model step failed"), (503, "Shutting down")]
}
