"""The FastAPI application: its routes, the guard before them (guard.py), and one mapping of errors to JSON."""
from __future__ import annotations

import contextlib
import json
import logging
import time

from fastapi import Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..config import ServerConfig
from ..engine.engine import Engine
from ..errors import ApiError, HeldElsewhere, InvalidRequest, NotFound
from . import anthropic, console, embeddings, misc, ollama, ollama_manage, openai, responses, sessions, tgi
from .body_values import refuse_unusable_values
from .generation import ClientGoneLog
from .guard import GuardMiddleware, error_response
from .peers import Peers

log = logging.getLogger("kvserve.app")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('msg')}", None
    field = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return f"{field or 'body'}: {first.get('msg')}{more}", field


def create_app(engine: Engine, config: ServerConfig, api_keys: frozenset[str] = frozenset()) -> FastAPI:
    # the other servers on the shared --kv-disk, to which a request for a session one of them holds goes
    peers = Peers(engine.config.peers, engine.instance_id) if engine.config.peers else None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving model %s", config.model_name)
        yield
        await engine.stop()
        if peers is not None:
            await peers.close()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan, dependencies=[Depends(refuse_unusable_values)])
    app.state.engine, app.state.config = engine, config
    app.state.started = int(time.time())
    app.state.instance_id = engine.instance_id  # this process's boot id: a router tells a restarted replica by it
    for module in (console, tgi, openai, responses, anthropic, ollama, ollama_manage, embeddings, sessions, misc):
        app.include_router(module.router)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        if isinstance(exc, HeldElsewhere) and peers is not None:
            return await peers.forward(request, exc)
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        message, field = _validation_message(exc)
        return error_response(InvalidRequest(message, param=field), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        err = (NotFound if exc.status_code == 404 else InvalidRequest)(detail, headers=getattr(exc, "headers", None))
        err.status = exc.status_code
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("unhandled error")
        return error_response(ApiError(f"internal error: {type(exc).__name__}"), request.url.path)

    app.add_middleware(GuardMiddleware, keys=api_keys, config=config)
    app.add_middleware(ClientGoneLog)
    if config.allowed_origins:  # added last, so outside the guard: a preflight carries no API key
        # any request header, as vLLM allows: the browser SDKs send their own (x-stainless-*, anthropic-*);
        # the origin list is the gate
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    return app
