"""The FastAPI application: routes, API keys, body limit, and one mapping of errors to JSON."""
from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..config import ServerConfig
from ..engine.engine import Engine
from ..engine.session import principal
from ..errors import ApiError, InvalidRequest, NotFound, PayloadTooLarge, Unauthorized
from . import anthropic, console, misc, ollama, openai, responses, sessions, tgi

log = logging.getLogger("kvserve.app")
PUBLIC_PATHS = {"/health"}
MAX_TENANT_NAME = 256


def _error_response(err: ApiError, path: str = "") -> JSONResponse:
    """Every error's JSON: in Anthropic's or Ollama's shape under their routes (their clients read no other),
    else OpenAI's."""
    body = (anthropic.error_body(err) if anthropic.owns(path) else ollama.error_body(err) if ollama.owns(path)
            else err.body())
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class GuardMiddleware:
    """Checks the API key and the body size before a request reaches any route, names the tenant the
    request acts for, and reads every body as JSON whatever its content type, as llama-server does:
    `curl -d` without a header sends a form type."""

    def __init__(self, app, keys: frozenset[str], config: ServerConfig) -> None:
        self.app, self.keys, self.max_body = app, keys, config.max_body_bytes
        self.tenant_header = config.tenant_header.lower() if config.tenant_header else None
        self.proxies = frozenset(config.trusted_proxies)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        key = None
        public = scope["path"] in PUBLIC_PATHS or (scope["method"] == "GET" and scope["path"] in console.PUBLIC_PAGES)
        if self.keys and not public:
            auth = headers.get("authorization", "")
            # Anthropic's clients send the key as x-api-key
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "").strip() or None
            if key not in self.keys:
                msg = "missing API key" if key is None else "invalid API key"
                return await _error_response(Unauthorized(msg), scope["path"])(scope, receive, send)
        tenant = headers.get(self.tenant_header, "").strip() if self.tenant_header else ""
        client = (scope.get("client") or ("",))[0]
        trusted = key is not None or client in self.proxies  # anyone else could name any tenant
        if tenant and trusted and len(tenant) > MAX_TENANT_NAME:
            err = InvalidRequest(f"the {self.tenant_header} header is longer than {MAX_TENANT_NAME} characters")
            return await _error_response(err, scope["path"])(scope, receive, send)
        scope.setdefault("state", {})["owner"] = principal(key, tenant if tenant and trusted else None)
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] in ("POST", "PUT", "PATCH") and not (kind == "application/json" or kind.endswith("+json")):
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            err = PayloadTooLarge(f"request body of {length} bytes exceeds the limit of {self.max_body} bytes")
            return await _error_response(err, scope["path"])(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise PayloadTooLarge(f"request body exceeds the limit of {self.max_body} bytes")
            return message

        return await self.app(scope, limited_receive, send)


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
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        log.info("serving model %s", config.model_name)
        yield
        await engine.stop()

    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.config = engine, config
    app.state.started = int(time.time())
    app.state.instance_id = uuid.uuid4().hex  # this process's boot id: a router tells a restarted replica by it
    for module in (console, tgi, openai, responses, anthropic, ollama, sessions, misc):
        app.include_router(module.router)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        message, field = _validation_message(exc)
        return _error_response(InvalidRequest(message, param=field), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        err = (NotFound if exc.status_code == 404 else InvalidRequest)(detail, headers=getattr(exc, "headers", None))
        err.status = exc.status_code
        return _error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request, exc: Exception):
        log.exception("unhandled error")
        return _error_response(ApiError(f"internal error: {type(exc).__name__}"), request.url.path)

    app.add_middleware(GuardMiddleware, keys=api_keys, config=config)
    if config.allowed_origins:  # added last, so outside the guard: a preflight carries no API key
        # any request header, as vLLM allows: the browser SDKs send their own (x-stainless-*, anthropic-*);
        # the origin list is the gate
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
    return app
