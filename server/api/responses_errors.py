"""Errors under /v1/responses in the Responses API's shape: `code` is a string naming the error, or null.

The other OpenAI-shaped routes keep vLLM's error body, whose `code` is the HTTP status as an integer;
OpenAI's Responses clients read `code` as a string (the Agents SDK and the SDK's types), so these routes
give OpenAI's own codes where it has one, and null elsewhere, as OpenAI does for most invalid requests.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from ..errors import ApiError
from . import schemas

PREFIX = "/v1/responses"
NOT_FOUND_CODES = {"model": "model_not_found", "previous_response_id": "previous_response_not_found"}
STATUS_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded", 500: "server_error", 503: "server_error"}


def owns(path: str) -> bool:
    """Whether errors on this path take the Responses API's shape."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(err: ApiError) -> dict:
    code = NOT_FOUND_CODES.get(err.param) if err.status == 404 else STATUS_CODES.get(err.status)
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error under /v1/responses."""

    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {**doc, "model": ErrorResponse} for code, doc in schemas.ERROR_RESPONSES.items()
}
