"""Utility routes: /tokenize, /detokenize, the render routes, /health, /metrics, and what a router's
discovery and load balancing read (/get_server_info, /kv_event_sources, /get_load)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.kv_events import REPLAY_BATCHES
from ..errors import InvalidRequest
from . import generation, openai
from .schemas import ERROR_RESPONSES, ChatCompletionRequest, CompletionRequest
from .tokenize_schemas import DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["utility"], responses=ERROR_RESPONSES)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, http: HttpRequest) -> dict:
    """vLLM's shape (`count`, `max_model_len`, `tokens`; `token_strs` if asked), taking llama-server's
    `content` and `with_pieces` too."""
    generation.check_model(http, body.model)
    engine = generation.engine_of(http)
    tok = engine.tokenizer
    given = [name for name in ("prompt", "content", "messages") if getattr(body, name) is not None]
    if len(given) != 1:
        raise InvalidRequest(f"give exactly one of prompt, content or messages; got {', '.join(given) or 'none'}",
                             param=given[1] if given else "prompt")
    special = body.add_special_tokens if body.add_special_tokens is not None else body.add_special
    if body.messages is not None:
        ids = openai.chat_prompt(tok, body, add_special=bool(special))
    else:
        # vLLM's prompt gets the model's special tokens unless told not to; llama-server's content does not
        text = body.prompt if body.prompt is not None else body.content
        ids = tok.encode(text, add_special=special if special is not None else body.prompt is not None)
    out: dict = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}
    if body.with_pieces:
        out["tokens"] = [{"id": i, "piece": tok.decode([i], skip_special=False)} for i in ids]
    if body.return_token_strs:
        out["token_strs"] = [tok.tokenizer.id_to_token(i) for i in ids]
    return out


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, http: HttpRequest) -> dict:
    """The prompt ids a chat request runs on (vLLM's render route, which vllm-router's kv_aware policy
    asks before it routes): the chat route's own template, tools and all."""
    generation.check_model(http, body.model)
    return {"token_ids": openai.chat_prompt(generation.engine_of(http).tokenizer, body)}


@router.post("/v1/completions/render")
async def render_completions(body: CompletionRequest, http: HttpRequest) -> list[dict]:
    """Each prompt's ids, as the completions route encodes them."""
    generation.check_model(http, body.model)
    ids = openai.prompt_ids(generation.engine_of(http).tokenizer, openai.prompts_of(body.prompt))
    return [{"token_ids": one} for one in ids]


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, http: HttpRequest) -> dict:
    """vLLM's `prompt`, and the same text as llama-server's `content`."""
    generation.check_model(http, body.model)
    engine = generation.engine_of(http)
    vocab = engine.model.config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    text = engine.tokenizer.decode(body.tokens, skip_special=False)
    return {"prompt": text, "content": text}


@router.get("/health")
async def health(http: HttpRequest):
    engine = generation.engine_of(http)
    if not engine.accepting:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok", "model": http.app.state.config.model_name}


@router.head("/health", response_class=Response, responses={200: {"description": "Serving"}})
async def health_head(http: HttpRequest) -> Response:
    """For probes that send HEAD (load balancers, uptime checks): the status alone."""
    return Response(status_code=200 if generation.engine_of(http).accepting else 503)


@router.get("/metrics")
async def metrics(http: HttpRequest) -> Response:
    return Response(generation.engine_of(http).render_metrics(), media_type=CONTENT_TYPE_LATEST)


@router.get("/get_server_info")
async def server_info(http: HttpRequest) -> dict:
    """The model, this process's boot id and the block size of its KV events, in the fields vllm-router's
    discovery reads (SGLang's shape)."""
    engine = generation.engine_of(http)
    name = http.app.state.config.model_name
    return {"model_id": name, "model_path": name, "instance_id": http.app.state.instance_id,
            "kv_block_size": engine.pool.blocks.block_size, "worker_type": "regular",
            "max_model_len": engine.max_context, "kv_events": engine.config.kv_events is not None}


@router.get("/kv_event_sources")
async def kv_event_sources(http: HttpRequest) -> dict:
    """Where this server publishes its KV events, keyed by data-parallel rank as vLLM's KVEventsConfig is:
    one rank, or none without --kv-events. A wildcard host (tcp://*:P) is the router's to fill in."""
    config = generation.engine_of(http).config
    if config.kv_events is None:
        return {}
    return {"0": {"endpoint": config.kv_events, "replay_endpoint": config.kv_events_replay, "topic": "",
                  "publisher": "zmq", "encoding": "msgpack", "schema_version": 1, "buffer_steps": REPLAY_BATCHES,
                  "enable_kv_cache_events": True}}


@router.get("/get_load")
async def load(http: HttpRequest) -> dict:
    """Requests running and waiting here: what vllm-router's power_of_two compares (SGLang's shape)."""
    engine = generation.engine_of(http)
    with engine.lock:
        running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
    return {"load": running + waiting, "num_reqs": running, "num_waiting_reqs": waiting}
