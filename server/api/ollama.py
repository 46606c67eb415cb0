"""Ollama-compatible routes: /api/chat, /api/generate (NDJSON streams), /api/tags, /api/show, /api/ps,
/api/version; errors under /api/ in Ollama's shape, {"error": message}.

A thin adapter over the generation path the OpenAI routes take: chat messages and tools go through
tools.py, `format` through the same grammars, and the reply's text through the same output stream and
reader (ollama_reply.py). `think` switches the template's thinking on or off (Qwen3's enable_thinking); a
model whose template has no thinking refuses `think: true`, as Ollama does.
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response, StreamingResponse

from ..engine.sequence import Sequence
from ..errors import InvalidRequest, NotFound, cut
from . import chat_render, chat_template, generation, model_names
from .ollama_reply import NDJSON, OllamaReply, line, now, respond
from .ollama_reply import error_body  # noqa: F401  (guard.py renders errors under PREFIX with it)
from .ollama_schemas import DEFAULTS, ERRORS, OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from .reply import ReplyReader
from .schemas import ChatCompletionRequest

PREFIX = "/api/"
# the Ollama release whose API this speaks (format schemas, tools, streamed tool calls): clients gate features on it
OLLAMA_VERSION = "0.8.0"
STREAMED = {200: {"content": {NDJSON: {}}, "description": "One JSON object a line (or one object, with stream false)"}}
router = APIRouter(tags=["ollama"], responses=ERRORS)
log = logging.getLogger("kvserve.ollama")


def owns(path: str) -> bool:
    return path.startswith(PREFIX)


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


def _template_variables(http: HttpRequest, body) -> dict | None:
    """`think` as the template's switch, a level as its reasoning effort (gpt-oss's; another template's switch
    on); None leaves the template's default, and so do true and false for gpt-oss, which always reasons."""
    tok = generation.engine_of(http).tokenizer
    if body.think not in (None, False) and not chat_template.thinks(tok):
        raise InvalidRequest(f"{cut(body.model)!r} does not support thinking", param="think")
    if isinstance(body.think, str):
        return chat_template.effort_variables(tok, body.think, "think")
    return None if body.think is None else {"enable_thinking": body.think is not False}


def _tool_call_ids(messages: list) -> list[str | None]:
    """The call each tool message answers: Ollama's messages name no ids, so the earlier assistant message's
    calls are answered in order (a template that renders results by id, as Mistral's, needs one)."""
    ids, pending = [], []
    for i, m in enumerate(messages):
        if m.role == "assistant":
            pending = [_call_id(c, i, j) for j, c in enumerate(m.tool_calls or ())]
        ids.append(pending.pop(0) if m.role == "tool" and pending else None)
    return ids


def _call_id(call, i: int, j: int) -> str:
    return call.id or f"call_{i}_{j}"


def chat_request(body: OllamaChatRequest, variables: dict | None) -> ChatCompletionRequest:
    """The OpenAI-shaped chat an /api/chat request means: a reply of calls alone with no content, as OpenAI's
    come back, and each result named by its tool."""
    return ChatCompletionRequest(messages=[{
        "role": m.role, "content": None if m.tool_calls and not m.content else m.content or "",
        "reasoning_content": m.thinking, "tool_call_id": answers, "name": m.tool_name if m.role == "tool" else None,
        "tool_calls": [{"id": _call_id(c, i, j), "function": {"name": c.function.name,
                                                            "arguments": json.dumps(c.function.arguments)}}
                       for j, c in enumerate(m.tool_calls)] if m.tool_calls else None,
    } for i, (m, answers) in enumerate(zip(body.messages, _tool_call_ids(body.messages)))],
        tools=body.tools or None, chat_template_kwargs=variables)


async def _start(http: HttpRequest, body, prompt: list[int], reader: ReplyReader, tools_offered: bool = False) -> Sequence:
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
    grammar = await asyncio.to_thread(_grammar, http, body, tools_offered)  # compiles: off the loop
    params = reader.sampling(o.sampling(max_tokens, grammar))
    generation.check_stops(http, params.stop, "options.stop")
    return generation.start(http, generation.session_id_of(http, body.session_id), prompt, params, resend=True)[0]


def _loaded(model: str, chat: bool, stream: bool, unload: bool):
    """Ollama's answer to a request with nothing to generate from: the model is loaded (clients warm it so),
    or, under keep_alive 0, unloaded (clients free it so; here it stays loaded for the server's life)."""
    out = {"model": model, "created_at": now(), **({"message": {"role": "assistant", "content": ""}} if chat
                                                     else {"response": ""}), "done": True,
           "done_reason": "unload" if unload else "load"}
    return StreamingResponse(iter([line(out)]), media_type=NDJSON) if stream else out


def _no_images(images: list | None, param: str) -> None:
    if images:
        raise InvalidRequest("image inputs are not supported", param=param)


@router.post("/api/chat", responses=STREAMED)
async def chat(body: OllamaChatRequest, http: HttpRequest):
    _check_model(http, body.model)
    for i, m in enumerate(body.messages):
        _no_images(m.images, f"messages.{i}.images")
    variables = _template_variables(http, body)
    if not body.messages:
        return _loaded(body.model, True, body.stream, body.unloads)
    tok = generation.engine_of(http).tokenizer
    rendered = chat_render.render_chat(tok, chat_request(body, variables))
    reader = rendered.reader if body.format in (None, "") else rendered.reader.constrained()
    req = await _start(http, body, rendered.ids, reader, tools_offered=bool(reader.names))
    return await respond(OllamaReply(http, req, body.model, True, reader), body.stream)


@router.post("/api/generate", responses=STREAMED)
async def generate(body: OllamaGenerateRequest, http: HttpRequest):
    _check_model(http, body.model)
    _no_images(body.images, "images")
    if body.suffix:
        raise InvalidRequest("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.template:
        raise InvalidRequest("template is not supported: kvserve renders the model's own chat template", param="template")
    variables = _template_variables(http, body)
    if not body.prompt and not body.context:
        return _loaded(body.model, False, body.stream, body.unloads)
    tok = generation.engine_of(http).tokenizer
    context = list(body.context or [])
    reader = ReplyReader()  # a raw prompt is the client's own: no template says how its reply thinks
    if body.raw:
        prompt = tok.encode(body.prompt or "", add_special=not context)
    else:
        turn = ([{"role": "system", "content": body.system}] if body.system else []) + [
            {"role": "user", "content": body.prompt or ""}]
        text = chat_template.render(tok, turn, True, None, variables)
        prompt = tok.encode(text, add_special=False)
        reader = chat_render.prompt_reader(tok, text)
    prompt = context + prompt
    reader = reader if body.format in (None, "") else reader.constrained()
    req = await _start(http, body, prompt, reader)
    return await respond(OllamaReply(http, req, body.model, False, reader, prompt), body.stream)


def _parameter_count(c) -> int:
    """Weights of a Llama-family decoder with this config (norms and biases included)."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    attention = c.dim * (q + 2 * kv) + q * c.dim + ((q + 2 * kv) if c.qkv_bias else 0)
    layer = attention + 3 * c.dim * c.ffn_dim + 2 * c.dim
    return c.vocab_size * c.dim * (1 if c.tie_embeddings else 2) + c.n_layers * layer + c.dim


def _describe(http: HttpRequest) -> dict:
    """The served model as /api/tags lists it: its size is its weights' bytes as held."""
    model = generation.engine_of(http).model
    name, count = model_names.tagged(http.app.state.config.model_name), _parameter_count(model.config)
    digest = model.fingerprint or hashlib.sha256(f"{model.name}/{model.weights}".encode()).hexdigest()
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.2f}M"
    details = {"parent_model": "", "format": "kvserve", "family": model.config.architecture,
               "families": [model.config.architecture], "parameter_size": size,
               "quantization_level": model.quantization()}
    modified = datetime.datetime.fromtimestamp(http.app.state.started, datetime.timezone.utc).isoformat()
    return {"name": name, "model": name, "modified_at": modified.replace("+00:00", "Z"),
            "size": model.held_bytes or 4 * count, "digest": digest, "details": details}


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
            "capabilities": ["completion", "tools", *(["thinking"] if chat_template.thinks(engine.tokenizer) else [])],
            "modified_at": described["modified_at"],
            "tensor_types": dict(engine.model.held)}


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
