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


def _refuse(http: HttpRequest, what: str):
    route = f"{http.method} {http.scope['route'].path}"  # the route's own path: no client text in the message
    raise NotSupported(f"{route} is not supported: kvserve does not {what}; it serves the one model it was "
                       "started with")


@router.post("/api/pull")
async def pull(http: HttpRequest):
    _refuse(http, "download models")


@router.post("/api/push")
async def push(http: HttpRequest):
    _refuse(http, "upload models")


@router.post("/api/create")
async def create(http: HttpRequest):
    _refuse(http, "create models")


@router.post("/api/copy")
async def copy(http: HttpRequest):
    _refuse(http, "copy models")


@router.delete("/api/delete")
async def delete(http: HttpRequest):
    _refuse(http, "delete models")


@router.post("/api/blobs/{digest}")
async def push_blob(digest: str, http: HttpRequest):
    _refuse(http, "store blobs")


@router.head("/api/blobs/{digest}", response_class=Response)
async def has_blob(digest: str, http: HttpRequest):
    _refuse(http, "store blobs")
