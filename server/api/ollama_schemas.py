"""Request bodies of Ollama's API (/api/chat, /api/generate, /api/show), validated by pydantic, and its error shape.

Options that only tune loading or speed (num_gpu, num_thread, ...) are accepted and ignored. Sampling
options kvserve does not implement are accepted only at the value that turns them off, and refused
otherwise, by name: a client must not get a different sampler than it asked for without knowing it.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, model_validator

from ..engine.sampling import SamplingParams
from ..errors import cut
from .durations import duration_seconds
from .schemas import MAX_TOKENS_LIMIT, StopList, Tool, _Body, _fail

# Ollama's own defaults, where a request names none. Its repeat_penalty 1.1 is left out: without it the
# routes' greedy text stays the OpenAI routes' (a client that sends it gets it, over repeat_last_n's window).
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_last_n": 64}
# an option kvserve does not implement -> the value at which it changes nothing (llama.cpp dropped
# tail-free sampling, so Ollama's runners no longer honour it either)
OFF_VALUES = {"tfs_z": 1.0}


class OllamaOptions(_Body):
    """`options`: Ollama's sampling parameters and its runner's settings."""

    num_predict: Annotated[int, Field(ge=-2, le=MAX_TOKENS_LIMIT)] | None = None  # -1: unbounded, -2: fill the context
    num_ctx: Annotated[int, Field(gt=0, le=2**31 - 1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # negative: a random seed, as Ollama's -1
    stop: Annotated[str, Field(min_length=1, max_length=256)] | StopList | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repeat_last_n: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    typical_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # 1: off
    tfs_z: float | None = None
    mirostat: Annotated[int, Field(ge=0, le=2)] | None = None  # 0: off; 1 or 2: its version, in place of the filters
    mirostat_tau: Annotated[float, Field(ge=0.0, le=100.0)] | None = None  # only read by mirostat
    mirostat_eta: Annotated[float, Field(ge=0.0, le=10.0)] | None = None
    penalize_newline: bool | None = None  # Ollama's own engine no longer reads it
    # how the model is loaded and run, not what it samples
    num_keep: int | None = None  # what a context shift keeps; kvserve never shifts (it refuses what does not fit)
    num_batch: int | None = None
    num_gpu: int | None = None
    main_gpu: int | None = None
    num_thread: int | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None

    @model_validator(mode="after")
    def _unimplemented(self):
        for name, off in OFF_VALUES.items():
            value = getattr(self, name)
            if value is not None and value != off:
                raise ValueError(f"'{name}' is not supported (only {off}, which turns it off)")
        return self

    def sampling(self, max_tokens: int | None, grammar: str | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        defaults = SamplingParams()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature if self.temperature is not None else DEFAULTS["temperature"],
            top_k=self.top_k if self.top_k is not None else DEFAULTS["top_k"],
            top_p=self.top_p if self.top_p is not None else DEFAULTS["top_p"],
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repeat_penalty or 1.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            # as llama.cpp: the penalties count the last repeat_last_n tokens of the context (-1: all; 0: none)
            penalty_window=self.repeat_last_n if self.repeat_last_n is not None else DEFAULTS["repeat_last_n"],
            typical_p=self.typical_p if self.typical_p is not None else 1.0,
            mirostat=self.mirostat or 0,
            mirostat_tau=self.mirostat_tau if self.mirostat_tau is not None else defaults.mirostat_tau,
            mirostat_eta=self.mirostat_eta if self.mirostat_eta is not None else defaults.mirostat_eta,
            seed=self.seed if self.seed is not None and self.seed >= 0 else None,
            stop=stop,
            grammar=grammar,
        )


def _duration(value: Any) -> Any:
    # keep_alive as a Go duration, as Ollama parses it ("5m", "1h30m", "0"): a unit after every number
    if isinstance(value, str) and duration_seconds(value) is None:
        _fail("duration", f"{cut(value)!r} is not a duration: a number of seconds, or e.g. \"5m\", \"1h30m\", \"0\"")
    return value


# seconds, or a Go duration; the model stays loaded for the server's life whatever it says
KeepAlive = Annotated[float | str | None, BeforeValidator(_duration)]


class _OllamaRequest(_Body):
    model: Annotated[str, Field(min_length=1, max_length=512)]
    stream: bool = True
    options: OllamaOptions = OllamaOptions()
    format: Literal["", "json"] | dict[str, Any] | None = None  # "json": any object; an object: its JSON schema
    keep_alive: KeepAlive = None
    think: bool | Literal["low", "medium", "high"] | None = None  # the template's thinking switch (ollama.py)
    session_id: str | None = None

    @property
    def unloads(self) -> bool:
        """keep_alive 0: Ollama unloads the model when the request ends (only that, with nothing to generate)."""
        if self.keep_alive is None:
            return False
        if not isinstance(self.keep_alive, str):
            return self.keep_alive == 0
        return duration_seconds(self.keep_alive) == 0


class OllamaFunctionCall(_Body):
    index: int | None = None
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(_Body):
    id: str | None = None
    type: Literal["function"] | None = None
    function: OllamaFunctionCall


class OllamaMessage(_Body):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None  # an assistant's earlier calls
    tool_name: str | None = None  # the call a tool message answers (the Hermes format does not name it)
    thinking: str | None = None  # an earlier reply's thinking: its reasoning_content, for templates that keep it


class OllamaChatRequest(_OllamaRequest):
    """`POST /api/chat` body."""

    messages: Annotated[list[OllamaMessage], Field(max_length=4096)] = []
    tools: Annotated[list[Tool], Field(max_length=128)] | None = None


class OllamaGenerateRequest(_OllamaRequest):
    """`POST /api/generate` body."""

    prompt: str | None = ""
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    context: Annotated[list[int], Field(max_length=1 << 20)] | None = None  # an earlier reply's `context`: continued
    raw: bool = False
    images: list[str] | None = None


class OllamaShowRequest(_Body):
    """`POST /api/show` body (older clients send `name`)."""

    model: str | None = None
    name: str | None = None
    verbose: bool = False


class OllamaError(BaseModel):
    """Every error under /api/."""

    error: str


ERRORS = {code: {"model": OllamaError, "description": text} for code, text in
          [(400, "Invalid request"), (401, "Missing or wrong API key"), (404, "No such model"),
           (408, "Deadline passed while queued"), (413, "Body too large"), (429, "Server full"),
           (500, "A model step failed"), (503, "Shutting down")]}
