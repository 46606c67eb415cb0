"""Embeddings from the served model: OpenAI's and vLLM's /v1/embeddings, Ollama's /api/embed and its older
/api/embeddings.

Each input is one engine request (`Engine.embed`): its prompt is prefilled whole on a temporary session
of the caller's tenant, beside everyone's decodes, and it finishes with its final normed hidden states
pooled (--pooling mean or last) and L2-normalized. This module only checks and cuts the inputs, and
renders the vectors in each dialect's shape.
"""
from __future__ import annotations

import asyncio
import base64
import time

import torch
from fastapi import APIRouter
from fastapi import Request as HttpRequest

from ..engine.sequence import Finished, Scheduling
from ..errors import InvalidRequest, TimedOut
from . import generation, ollama
from .embeddings_schemas import EmbeddingRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest
from .ollama_schemas import ERRORS as OLLAMA_ERRORS
from .schemas import ERROR_RESPONSES

# An input list's requests in the engine at once. More would not run sooner (a step holds --max-batch-tokens
# of them), and would take the queue's room, and the tenant's, from everyone else's requests.
WINDOW = 32
router = APIRouter(tags=["embeddings"])


def _check_ids(http: HttpRequest, ids: list[int], i: int, several: bool) -> None:
    engine = generation.engine_of(http)
    vocab = engine.model.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    which = f"input {i}" if several else "input"
    if bad is not None:
        raise InvalidRequest(f"{which}: token id {bad} is outside the vocabulary (0..{vocab - 1})", param="input")
    limit = min(engine.max_context, engine.config.max_prompt_tokens)
    if len(ids) > limit:
        raise InvalidRequest(f"{which} has {len(ids)} tokens, more than the {limit} this model takes", param="input")


def _check_width(http: HttpRequest, dimensions: int | None) -> None:
    """The vector is the model's own width: nothing here truncates it (no model served is trained to be cut)."""
    width = generation.engine_of(http).model.config.dim
    if dimensions is not None and dimensions != width:
        raise InvalidRequest(f"dimensions {dimensions} is not supported: this model's embeddings have {width}",
                             param="dimensions")


async def _embed(http: HttpRequest, prompts: list[list[int]], priority: int = 0) -> list[torch.Tensor]:
    """Each prompt's pooled, normalized vector, in order; at most WINDOW in the engine at once. A failed
    input (a 429, a failed step) fails the request, and the others are cancelled."""
    engine, owner = generation.engine_of(http), generation.owner_of(http)
    slots = asyncio.Semaphore(WINDOW)

    async def one(ids: list[int]) -> Finished:
        async with slots:
            req = engine.embed(ids, owner, Scheduling(priority=priority))
            # raises the request's error; cancels the request if the client goes away
            _, finished = await generation.collect(http, req)
            if finished.embedding is None:  # it ended before its prompt was done: its deadline passed while it ran
                raise TimedOut("the request's deadline passed before its input was embedded", param="timeout")
            return finished

    tasks = [asyncio.ensure_future(one(p)) for p in prompts]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return [f.embedding for f in done]


def _encoded(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def embeddings(body: EmbeddingRequest, http: HttpRequest) -> dict:
    """OpenAI's and vLLM's shape; a string input gets the model's special tokens, token ids run as sent."""
    generation.check_model(http, body.model)
    _check_width(http, body.dimensions)
    tok = generation.engine_of(http).tokenizer
    inputs = body.inputs
    prompts = [tok.encode(p, add_special=body.add_special_tokens) if isinstance(p, str) else p for p in inputs]
    for i, ids in enumerate(prompts):
        if not ids:
            raise InvalidRequest(f"input {i} has no tokens" if len(prompts) > 1 else "input has no tokens",
                                 param="input")
        _check_ids(http, ids, i, len(prompts) > 1)
    vectors = await _embed(http, prompts, body.priority)
    n = sum(map(len, prompts))
    data = [{"object": "embedding", "index": i, "embedding": _encoded(v, body.encoding_format)}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": http.app.state.config.model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}


def _ollama_prompts(http: HttpRequest, texts: list[str], truncate: bool, num_ctx: int | None) -> list[list[int]]:
    """Each text's ids, cut to the context (`num_ctx`, at most the model's) unless `truncate` is false, which
    refuses a text too long, as Ollama does."""
    engine = generation.engine_of(http)
    limit = min(num_ctx or engine.max_context, engine.max_context, engine.config.max_prompt_tokens)
    prompts = []
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequest(f"input {i} is empty", param="input")
        ids = engine.tokenizer.encode(text)
        if len(ids) > limit and not truncate:
            raise InvalidRequest(f"the input length ({len(ids)} tokens) exceeds the context length ({limit})",
                                 param="input")
        prompts.append(ids[:limit])
    return prompts


@router.post("/api/embed", responses=OLLAMA_ERRORS)
async def ollama_embed(body: OllamaEmbedRequest, http: HttpRequest) -> dict:
    """Ollama's shape and figures; no input (an empty string or list) loads the model, as Ollama's does."""
    start = time.monotonic()
    ollama._check_model(http, body.model)  # in Ollama's words, with its tags
    _check_width(http, body.dimensions)
    texts = ([body.input] if body.input else []) if isinstance(body.input, str) else body.input
    prompts = _ollama_prompts(http, texts, body.truncate, body.options.num_ctx)
    vectors = await _embed(http, prompts) if prompts else []
    return {"model": body.model, "embeddings": [v.tolist() for v in vectors],
            "total_duration": max(0, int((time.monotonic() - start) * 1e9)), "load_duration": 0,
            "prompt_eval_count": sum(map(len, prompts))}


@router.post("/api/embeddings", responses=OLLAMA_ERRORS)
async def ollama_embeddings(body: OllamaEmbeddingsRequest, http: HttpRequest) -> dict:
    """The older route: one prompt, cut to the context; an empty one loads the model (an empty vector)."""
    ollama._check_model(http, body.model)  # in Ollama's words, with its tags
    if not body.prompt:
        return {"embedding": []}
    vectors = await _embed(http, _ollama_prompts(http, [body.prompt], True, body.options.num_ctx))
    return {"embedding": vectors[0].tolist()}
