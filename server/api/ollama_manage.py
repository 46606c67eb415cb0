"""Ollama's model management routes, which kvserve does not implement: it serves the one model it was
started with. Each answers 501 with an error in Ollama's shape naming the route, which its clients show,
rather than a bare 404 that reads as a wrong address or an old server."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi import Request as HttpRequest
from fastapi.responses import Response

from ..errors import NotSupported

# Out of the OpenAPI schema: these answer Ollama's clients, and are no part of kvserve's own API.
router = APIRouter(include_in_schema=False)


# (method, path, what kvserve does not do)
ROUTES = [("POST", "/api/pull", "download models"), ("POST", "/api/push", "upload models"),
          ("POST", "/api/create", "create models"), ("POST", "/api/copy", "copy models"),
          ("DELETE", "/api/delete", "delete models"), ("POST", "/api/blobs/{digest}", "store blobs"),
          ("HEAD", "/api/blobs/{digest}", "store blobs")]


def _refusal(method: str, path: str, what: str):
    async def refuse(http: HttpRequest) -> Response:
        # the route's own path, not the client's: no client text in the message
        raise NotSupported(f"{method} {path} is not supported: kvserve does not {what}; it serves the one model "
                           "it was started with")
    return refuse


for _method, _path, _what in ROUTES:
    router.add_api_route(_path, _refusal(_method, _path, _what), methods=[_method], response_class=Response)
