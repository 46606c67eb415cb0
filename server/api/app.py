"""The FastAPI application: routes, API keys, body limit, and one mapping of errors to JSON."""
from __future__ import annotations

import contextlib
import json
import logging
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import ServerConfig
from ..engine.engine import Engine
from ..engine.session import principal
from ..errors import ApiError, InvalidRequest, PayloadTooLarge, Unauthorized
from . import console, misc, openai, sessions, tgi

log = logging.getLogger("kvserve.app")
PUBLIC_PATHS = {"/health"}
MAX_TENANT_NAME = 256


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


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
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else None
            if key not in self.keys:
                msg = "missing API key" if key is None else "invalid API key"
                return await _error_response(Unauthorized(msg))(scope, receive, send)
        tenant = headers.get(self.tenant_header, "").strip() if self.tenant_header else ""
        client = (scope.get("client") or ("",))[0]
        trusted = key is not None or client in self.proxies  # anyone else could name any tenant
        if tenant and trusted and len(tenant) > MAX_TENANT_NAME:
            err = InvalidRequest(f"the {self.tenant_header} header is longer than {MAX_TENANT_NAME} characters")
            return await _error_response(err)(scope, receive, send)
        scope.setdefault("state", {})["owner"] = principal(key, tenant if tenant and trusted else None)
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if scope["method"] in ("POST", "PUT", "PATCH") and not (kind == "application/json" or kind.endswith("+json")):
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            err = PayloadTooLarge(f"request body of {length} bytes exceeds the limit of {self.max_body} bytes")
            return await _error_response(err)(scope, receive, send)
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
    for module in (console, tgi, openai, sessions, misc):
        app.include_router(module.router)

    @app.exception_handler(ApiError)
    async def api_error(_, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, exc: RequestValidationError):
        message, field = _validation_message(exc)
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": field, "code": 400}},
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse({"error": {"message": detail, "type": kind, "param": None, "code": exc.status_code}},
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                       "param": None, "code": 500}}, status_code=500)

    app.add_middleware(GuardMiddleware, keys=api_keys, config=config)
    return app
