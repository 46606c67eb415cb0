"""Utility routes: /tokenize, /detokenize, /health, /metrics."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ..errors import InvalidRequest
from . import generation, tools
from .schemas import ERROR_RESPONSES, DetokenizeRequest, TokenizeRequest

router = APIRouter(tags=["utility"], responses=ERROR_RESPONSES)


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, http: HttpRequest) -> dict:
    tok = generation.engine_of(http).tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("give exactly one of prompt or messages", param="prompt")
    if body.messages is not None:
        ids = tok.encode(tok.apply_chat_template([tools.plain_message(m) for m in body.messages]), add_special=False)
    else:
        ids = tok.encode(body.prompt, add_special=body.add_special_tokens)
    return {"tokens": ids, "count": len(ids), "max_model_len": generation.engine_of(http).max_context}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, http: HttpRequest) -> dict:
    engine = generation.engine_of(http)
    vocab = engine.model.config.vocab_size
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special=False)}


@router.get("/health")
async def health(http: HttpRequest):
    engine = generation.engine_of(http)
    if not engine.accepting:
        return JSONResponse({"status": "draining"}, status_code=503)
    return {"status": "ok", "model": http.app.state.config.model_name}


@router.get("/metrics")
async def metrics(http: HttpRequest) -> Response:
    return Response(generation.engine_of(http).render_metrics(), media_type=CONTENT_TYPE_LATEST)
