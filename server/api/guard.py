"""Who may call, and from where: API keys and the operator's key, the tenant a request acts for, trusted
proxies, browser origins and Host names, and the body limit. It runs before any route.

- A tenant header is honoured under an API key, or from a --trusted-proxy judged by the socket's peer.
  uvicorn's own proxy handling is off (server/listener.py); its middleware runs here, after that
  judgement, with --trusted-proxy as its forwarded_allow_ips, so X-Forwarded-For names no one's tenant.
- Under --api-key, the operator's routes (every tenant's load and metrics) need --admin-key.
- A web page may send a cross-site "simple" request (a form, or text/plain) without asking first, so a
  body that is not declared JSON is read as JSON only without an Origin, from the server's own
  origin, or from an allowed one. `curl -d` sends no Origin, so it keeps working.
- A server bound to loopback answers only Host names that mean this machine (or --allowed-hosts): a
  page whose DNS name is rebound to 127.0.0.1 sends its own name, and is refused.
"""
from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from ..config import ServerConfig
from ..listener import allowed_hosts, host_name
from ..engine.session import principal
from ..errors import ApiError, Forbidden, InvalidRequest, PayloadTooLarge, Unauthorized
from . import anthropic, console, ollama, responses_errors

PUBLIC_PATHS = {"/health"}
OPERATOR_PATHS = {"/metrics", "/get_load"}  # every tenant's load: the operator's, under keys
MAX_TENANT_NAME = 256
BODY_METHODS = ("POST", "PUT", "PATCH")


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    """Every error's JSON: in Anthropic's or Ollama's shape under their routes (their clients read no other),
    else OpenAI's (under /v1/responses, with the Responses API's string codes)."""
    body = (anthropic.error_body(err) if anthropic.owns(path) else ollama.error_body(err) if ollama.owns(path)
            else responses_errors.error_body(err) if responses_errors.owns(path) else err.body())
    return JSONResponse(body, status_code=err.status, headers=err.headers)


class GuardMiddleware:
    """Checks keys, tenant, origin, Host and body size before a request reaches any route, and reads every
    body as JSON whatever its content type, as llama-server does, where no web page can have sent it."""

    def __init__(self, app, keys: frozenset[str], config: ServerConfig) -> None:
        self.keys, self.admin, self.max_body = keys, config.admin_key, config.max_body_bytes
        self.tenant_header = config.tenant_header.lower() if config.tenant_header else None
        self.app = ProxyHeadersMiddleware(app, trusted_hosts=list(config.trusted_proxies))
        self.proxies = self.app.trusted_hosts
        self.origins = frozenset(config.allowed_origins)
        self.hosts = allowed_hosts(config.host, config.allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            scope, receive = await self._admit(scope, receive)
        except ApiError as err:
            return await error_response(err, scope["path"])(scope, receive, send)
        await self.app(scope, receive, send)

    async def _admit(self, scope, receive):
        """The request as the routes see it -> (scope, receive), or raises an ApiError."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if self.hosts is not None and host_name(headers.get("host", "")) not in self.hosts:
            raise InvalidRequest("invalid Host header: this server answers only the names it was started for "
                                 "(--allowed-hosts)")
        key = self._key(headers, path, scope["method"])
        tenant = headers.get(self.tenant_header, "").strip() if self.tenant_header else ""
        peer = (scope.get("client") or ("",))[0]
        trusted = (key is not None and key in self.keys) or peer in self.proxies  # anyone else could name any tenant
        if tenant and trusted and len(tenant) > MAX_TENANT_NAME:
            raise InvalidRequest(f"the {self.tenant_header} header is longer than {MAX_TENANT_NAME} characters")
        own = key if key in self.keys else None  # the operator's key acts as no tenant
        scope.setdefault("state", {})["owner"] = principal(own, tenant if tenant and trusted else None)
        if scope["method"] not in BODY_METHODS:
            return scope, receive
        kind = headers.get("content-type", "").split(";")[0].strip().lower()
        if not (kind == "application/json" or kind.endswith("+json")):
            if not self._origin_allowed(headers):
                raise Forbidden("a cross-site request must send Content-Type: application/json (and is then "
                                "subject to CORS, --allowed-origins)")
            scope = {**scope, "headers": [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
                     + [(b"content-type", b"application/json")]}
        length = headers.get("content-length")
        if length is not None:
            if length.isdigit() and int(length) > self.max_body:
                raise PayloadTooLarge(f"request body of {length} bytes exceeds the limit of {self.max_body} bytes")
            return scope, receive
        return scope, await self._buffered(receive)

    def _key(self, headers: dict, path: str, method: str) -> str | None:
        """The key the request presents, checked for the route -> the key, or None where none is needed."""
        # HEAD / too: Ollama's clients probe that a server is up with it
        public = path in PUBLIC_PATHS or (method in ("GET", "HEAD") and path in console.PUBLIC_PAGES)
        operator = path in OPERATOR_PATHS and (self.keys or self.admin is not None)
        if public or not (self.keys or operator):
            return None
        auth = headers.get("authorization", "")
        # Anthropic's clients send the key as x-api-key
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "").strip() or None
        admin = key is not None and self.admin is not None and hmac.compare_digest(key.encode(), self.admin.encode())
        if admin and (operator or path == "/v1/status"):
            return key  # the operator's view: the whole server's
        if operator and key in self.keys:
            raise Forbidden(f"{path} shows every tenant: it needs the server's --admin-key")
        if operator or key not in self.keys:
            raise Unauthorized("missing API key" if key is None else "invalid API key")
        return key

    def _origin_allowed(self, headers: dict) -> bool:
        origin = headers.get("origin")
        if origin is None or "*" in self.origins or origin.rstrip("/") in self.origins:
            return True
        parts = urlsplit(origin)  # the server's own pages (the console) send their own origin
        return parts.scheme in ("http", "https") and parts.netloc.lower() == headers.get("host", "").lower()

    async def _buffered(self, receive):
        """A body of unknown length (chunked), read whole within the limit -> a receive that replays it."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _replay(message, receive)
            body += message.get("body", b"")
            if len(body) > self.max_body:
                raise PayloadTooLarge(f"request body exceeds the limit of {self.max_body} bytes")
            if not message.get("more_body", False):
                return _replay({"type": "http.request", "body": bytes(body), "more_body": False}, receive)


def _replay(first: dict, receive):
    pending = [first]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
