"""Bodies of the embedding routes: OpenAI's and vLLM's /v1/embeddings, Ollama's /api/embed and its legacy
/api/embeddings."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from .ollama_schemas import KeepAlive, OllamaOptions
from .schemas import Priority, _fail
from .tokenize_schemas import _UtilityBody

MAX_INPUTS = 2048  # texts in one request, as OpenAI allows


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _openai_input(value: Any) -> Any:
    """A string, a list of strings, token ids, or a list of lists of ids; none of them empty."""
    several = isinstance(value, list) and value and (all(isinstance(v, str) for v in value) or all(map(_is_ids, value)))
    if not (isinstance(value, str) or _is_ids(value) or several):
        _fail("input_type", "input must be a string, a list of strings, token ids, or a list of lists of token ids")
    if several and len(value) > MAX_INPUTS:
        _fail("too_long", f"at most {MAX_INPUTS} inputs are allowed in one request, got {len(value)}")
    empty = next((i for i, v in enumerate(value if several else ()) if not v), None)
    if not value or empty is not None:
        _fail("too_short", "input is empty" if empty is None else f"input {empty} of the list is empty")
    return value


def _ollama_input(value: Any) -> Any:
    if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
        _fail("input_type", "input must be a string or a list of strings")
    if isinstance(value, list) and len(value) > MAX_INPUTS:
        _fail("too_long", f"at most {MAX_INPUTS} inputs are allowed in one request, got {len(value)}")
    return value


class EmbeddingRequest(_UtilityBody):
    """`POST /v1/embeddings`, as OpenAI and vLLM take it."""

    route: ClassVar[str] = "/v1/embeddings"
    input: Annotated[Any, BeforeValidator(_openai_input)]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32, as OpenAI's
    dimensions: Annotated[int, Field(gt=0)] | None = None  # only the model's own width: nothing truncates it
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: a string input gets the model's special tokens
    priority: Priority = 0

    @property
    def inputs(self) -> list[str | list[int]]:
        """Each input: a string, or its token ids."""
        one = isinstance(self.input, str) or _is_ids(self.input)
        return [self.input] if one else list(self.input)


class OllamaEmbedRequest(_UtilityBody):
    """`POST /api/embed`."""

    route: ClassVar[str] = "/api/embed"
    model: Annotated[str, Field(min_length=1, max_length=512)]
    input: Annotated[str | list[str], BeforeValidator(_ollama_input)] = ""
    truncate: bool = True  # cut an input to the context (options.num_ctx, else the model's); false: a 400
    options: OllamaOptions = OllamaOptions()
    keep_alive: KeepAlive = None
    dimensions: Annotated[int, Field(gt=0)] | None = None


class OllamaEmbeddingsRequest(_UtilityBody):
    """`POST /api/embeddings`, the older route: one `prompt`, one `embedding`."""

    route: ClassVar[str] = "/api/embeddings"
    model: Annotated[str, Field(min_length=1, max_length=512)]
    prompt: str = ""
    options: OllamaOptions = OllamaOptions()
    keep_alive: KeepAlive = None
