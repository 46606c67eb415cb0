"""Ollama-compatible routes: /api/chat, /api/generate (NDJSON streams), /api/tags, /api/show, /api/ps,
/api/version; errors under /api/ in Ollama's shape, {"error": message}.

A thin adapter over the generation path the OpenAI routes take: chat messages and tools go through
tools.py, `format` through the same grammars, and the reply's text through the same output stream.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import logging
import time

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from ..engine.sequence import Finished, Sequence, TokenEvent
from ..errors import ApiError, InvalidRequest, NotFound, cut
from . import generation, model_names, openai, tools
from .ollama_schemas import DEFAULTS, ERRORS, OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from .schemas import ChatCompletionRequest
from .tool_stream import ToolCallStream

PREFIX = "/api/"
# the Ollama release whose API this speaks (format schemas, tools, streamed tool calls): clients gate features on it
OLLAMA_VERSION = "0.8.0"
# "shutdown": the server's drain ended it ("abort", as the OpenAI routes say; Ollama's done_reason is free text)
REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "timeout", "cancelled": "stop", "error": "stop",
           "shutdown": "abort",
           "unmet": "length"}  # its grammar allowed nothing more: the output is incomplete
NDJSON = "application/x-ndjson"
BYTES_PER_WEIGHT = {"f32": 4.0, "f16": 2.0, "q4": 20 / 32}  # q4: Q4_1 blocks of 32 weights in 20 bytes
STREAMED = {200: {"content": {NDJSON: {}}, "description": "One JSON object a line (or one object, with stream false)"}}
router = APIRouter(tags=["ollama"], responses=ERRORS)
log = logging.getLogger("kvserve.ollama")


def owns(path: str) -> bool:
    return path.startswith(PREFIX)


def error_body(err: ApiError) -> dict:
    """An error in Ollama's shape: the app renders every error under /api/ through this."""
    return {"error": err.message}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def _check_model(http: HttpRequest, model: str) -> None:
    """Ollama names carry a tag: a served name (or alias) is this model bare or as `:latest`, the tag
    /api/tags lists; another tag is another model, not found, in Ollama's words."""
    if model_names.resolve(http.app.state.config, model) is None:
        raise NotFound(f"model '{cut(model)}' not found", param="model")


def _grammar(http: HttpRequest, body, tools_offered: bool) -> str | None:
    fmt = body.format
    if fmt in (None, ""):
        return None
    if tools_offered:
        raise InvalidRequest("format and tools together are not supported: a format leaves no room for tool calls",
                             param="format")
    grammars = generation.engine_of(http).grammars
    return grammars.check(grammars.json_schema({"type": "object"} if fmt == "json" else fmt, "format"), "format")


def _start(http: HttpRequest, body, prompt: list[int], tools_offered: bool = False) -> Sequence:
    """Submit the prompt with the request's options; `num_ctx` bounds the prompt and its reply together."""
    engine = generation.engine_of(http)
    o = body.options
    max_tokens = o.num_predict if o.num_predict is not None and o.num_predict >= 0 else None
    if o.num_ctx is not None:
        num_ctx = min(o.num_ctx, engine.max_context)  # as Ollama: a window past the model's is cut to it
        if num_ctx < o.num_ctx:
            log.warning("num_ctx %d exceeds the model's context of %d tokens: using %d", o.num_ctx, num_ctx, num_ctx)
        if len(prompt) >= num_ctx:
            raise InvalidRequest(f"the prompt of {len(prompt)} tokens does not fit in num_ctx {num_ctx}",
                                 param="options.num_ctx")
        room = num_ctx - len(prompt)
        max_tokens = room if max_tokens is None else min(room, max_tokens)
    params = o.sampling(max_tokens, _grammar(http, body, tools_offered))
    generation.check_stops(http, params.stop, "options.stop")
    return generation.start(http, generation.session_id_of(http, body.session_id), prompt, params, resend=True)[0]


def _figures(req: Sequence, f: Finished) -> dict:
    """The end's figures, in nanoseconds; load_duration is 0: the model was loaded when the server started."""
    def ns(seconds: float) -> int:
        return max(0, int(seconds * 1e9))

    end = time.monotonic()
    first = req.first_token_at or end
    return {"done_reason": REASONS[f.reason], "total_duration": ns(end - req.arrival), "load_duration": 0,
            "prompt_eval_count": f.prompt_tokens, "prompt_eval_duration": ns(first - (req.admitted_at or req.arrival)),
            "eval_count": f.completion_tokens, "eval_duration": ns((req.last_token_at or first) - first)}


class _Reply:
    """One request's reply as Ollama objects: its text piece by piece, then the end with its figures.
    A chat offered tools streams its content past the calls' markup and sends the calls at the end."""

    def __init__(self, http: HttpRequest, req: Sequence, model: str, chat: bool, names: set[str],
                 prompt: list[int] | None = None) -> None:
        self.http, self.req, self.model, self.chat, self.names, self.prompt = http, req, model, chat, names, prompt
        self.calls = ToolCallStream(names, False) if names else None

    def _object(self, text: str, done: bool, tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text, **({"tool_calls": tool_calls} if tool_calls else {})}
            return {"model": self.model, "created_at": _now(), "message": message, "done": done}
        return {"model": self.model, "created_at": _now(), "response": text, "done": done}

    def _end(self, f: Finished, text: str, tool_calls: list[dict]) -> dict:
        out = {**self._object(text, True, tool_calls), **_figures(self.req, f)}
        if self.prompt is not None:  # /api/generate: the history to send back as `context`, to continue it
            out["context"] = self.prompt + generation.engine_of(self.http).tokenizer.encode(f.output, add_special=False)
        return out

    def _tool_calls(self, output: str) -> tuple[str, list[dict]]:
        content, calls = tools.parse_tool_calls(output, self.names)
        return content or "", [{"function": {"name": c["function"]["name"],
                                             "arguments": json.loads(c["function"]["arguments"])}} for c in calls]

    def whole(self, f: Finished) -> dict:
        return self._end(f, *self._tool_calls(f.output))

    def piece(self, text: str) -> dict | None:
        if self.calls is not None:
            text, _ = self.calls.feed(text)  # a call's markup is held back: its call comes whole, at the end
        return self._object(text, False) if text else None

    def last(self, f: Finished) -> list[dict]:
        tail = (f.last.text if f.last is not None else "") + f.text
        out = [p for p in [self.piece(tail)] if p]
        if self.calls is None:
            return [*out, self._end(f, "", [])]
        rest, _ = self.calls.finish()
        _, calls = self._tool_calls(f.output)
        return [*out, *([self._object(rest, False)] if rest else []), self._end(f, "", calls)]

    async def lines(self):
        async for event in generation.events(self.http, self.req, watch_disconnect=False):
            if isinstance(event, TokenEvent):
                piece = self.piece(event.text) if event.text else None
                if piece is not None:
                    yield _line(piece)
                continue
            if event.error is not None:
                err = event.error
                yield _line(error_body(err if isinstance(err, ApiError) else ApiError(str(err))))
                return
            for obj in self.last(event):
                yield _line(obj)


def _line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def _respond(reply: _Reply, stream: bool):
    if stream:
        return StreamingResponse(reply.lines(), media_type=NDJSON, headers=generation.SSE_HEADERS)
    _, finished = await generation.collect(reply.http, reply.req)
    return reply.whole(finished)


def _loaded(model: str, chat: bool, stream: bool, unload: bool):
    """Ollama's answer to a request with nothing to generate from: the model is loaded (clients warm it so),
    or, under keep_alive 0, unloaded (clients free it so; here it stays loaded for the server's life)."""
    out = {"model": model, "created_at": _now(), **({"message": {"role": "assistant", "content": ""}} if chat
                                                     else {"response": ""}), "done": True,
           "done_reason": "unload" if unload else "load"}
    return StreamingResponse(iter([_line(out)]), media_type=NDJSON) if stream else out


def _no_images(images: list | None, param: str) -> None:
    if images:
        raise InvalidRequest("image inputs are not supported", param=param)


@router.post("/api/chat", responses=STREAMED)
async def chat(body: OllamaChatRequest, http: HttpRequest):
    _check_model(http, body.model)
    for i, m in enumerate(body.messages):
        _no_images(m.images, f"messages.{i}.images")
    if not body.messages:
        return _loaded(body.model, True, body.stream, body.unloads)
    tok = generation.engine_of(http).tokenizer
    as_openai = ChatCompletionRequest(messages=[{
        "role": m.role, "content": m.content or "",
        "tool_calls": [{"id": c.id or f"call_{j}", "function": {"name": c.function.name,
                                                              "arguments": json.dumps(c.function.arguments)}}
                       for j, c in enumerate(m.tool_calls)] if m.tool_calls else None,
    } for m in body.messages], tools=body.tools or None)
    prompt = openai.chat_prompt(tok, as_openai)
    names = tools.offered_names(as_openai)
    req = _start(http, body, prompt, tools_offered=bool(names))
    return await _respond(_Reply(http, req, body.model, True, names), body.stream)


@router.post("/api/generate", responses=STREAMED)
async def generate(body: OllamaGenerateRequest, http: HttpRequest):
    _check_model(http, body.model)
    _no_images(body.images, "images")
    if body.suffix:
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.template:
        raise InvalidRequest("template is not supported: kvserve renders the model's own chat template", param="template")
    if not body.prompt and not body.context:
        return _loaded(body.model, False, body.stream, body.unloads)
    tok = generation.engine_of(http).tokenizer
    context = list(body.context or [])
    if body.raw:
        prompt = tok.encode(body.prompt or "", add_special=not context)
    else:
        turn = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt or ""}]
        prompt = tok.encode(tok.apply_chat_template(turn, True), add_special=False)
    prompt = context + prompt
    req = _start(http, body, prompt)
    return await _respond(_Reply(http, req, body.model, False, set(), prompt), body.stream)


def _parameter_count(c) -> int:
    """Weights of a Llama-family decoder with this config (norms and biases included)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    attention = c.dim * (q + 2 * kv) + q * c.dim + ((q + 2 * kv) if c.qkv_bias else 0)
    layer = attention + 3 * c.dim * c.ffn_dim + 2 * c.dim
    return c.vocab_size * c.dim * (1 if c.tie_embeddings else 2) + c.n_layers * layer + c.dim


def _describe(http: HttpRequest) -> dict:
    """The served model as /api/tags lists it; its size is estimated from its weights' count and format."""
    model = generation.engine_of(http).model
    name, count = model_names.tagged(http.app.state.config.model_name), _parameter_count(model.config)
    digest = model.fingerprint or hashlib.sha256(f"{model.name}/{model.weights}".encode()).hexdigest()
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    details = {"parent_model": "", "format": "kvserve", "family": model.config.architecture,
               "families": [model.config.architecture], "parameter_size": size,
               "quantization_level": {"q4": "Q4_1"}.get(model.weights, model.weights.upper())}
    modified = datetime.datetime.fromtimestamp(http.app.state.started, datetime.timezone.utc).isoformat()
    return {"name": name, "model": name, "modified_at": modified.replace("+00:00", "Z"),
            "size": int(count * BYTES_PER_WEIGHT.get(model.weights, 4.0)), "digest": digest, "details": details}


@router.get("/api/tags")
async def tags(http: HttpRequest) -> dict:
    return {"models": [_describe(http)]}


@router.post("/api/show")
async def show(body: OllamaShowRequest, http: HttpRequest) -> dict:
    model = body.model or body.name
    if not model:
        raise InvalidRequest("model is required", param="model")
    _check_model(http, model)
    engine = generation.engine_of(http)
    c, described = engine.model.config, _describe(http)
    arch = c.architecture
    parameters = "\n".join(f"{k:<16}{v}" for k, v in DEFAULTS.items())
    info = {"general.architecture": arch, "general.parameter_count": _parameter_count(c),
            f"{arch}.context_length": engine.max_context, f"{arch}.embedding_length": c.dim,
            f"{arch}.block_count": c.n_layers, f"{arch}.feed_forward_length": c.ffn_dim,
            f"{arch}.attention.head_count": c.n_heads, f"{arch}.attention.head_count_kv": c.n_kv_heads,
            f"{arch}.rope.freq_base": c.rope_theta, f"{arch}.vocab_size": c.vocab_size}
    template = engine.tokenizer.meta.chat_template or ""
    return {"modelfile": f"# served by kvserve\nFROM {engine.model.name}\n"
                         + "".join(f"PARAMETER {k} {v}\n" for k, v in DEFAULTS.items()),
            "parameters": parameters, "template": template, "details": described["details"], "model_info": info,
            "capabilities": ["completion", "tools"], "modified_at": described["modified_at"]}


@router.get("/api/ps")
async def ps(http: HttpRequest) -> dict:
    # loaded for the server's life: keep_alive never unloads it
    forever = "2318-01-01T00:00:00Z"
    return {"models": [{**_describe(http), "expires_at": forever, "size_vram": 0,
                        "context_length": generation.engine_of(http).max_context}]}


@router.head("/", include_in_schema=False, response_class=Response)
async def running() -> Response:
    """Ollama's root answers HEAD (its clients' probe that a server is up); GET / stays the console's page."""
    return Response(status_code=200)


@router.get("/api/version")
async def version() -> dict:
    return {"version": OLLAMA_VERSION}
