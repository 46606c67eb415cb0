"""Typed errors for user-facing failures; one handler turns each into a JSON error with its status."""
from __future__ import annotations


def cut(value: str) -> str:
    """A client's id or name as an error message may show it: never more than 64 characters of what it sent."""
    return value if len(value) <= 64 else value[:61] + "..."


def quoted(value: str) -> str:
    return repr(cut(value))


class ApiError(Exception):
    """An error a client caused or must handle; carries its HTTP status."""

    status = 500
    kind = "server_error"

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.headers = message, param, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class InvalidRequest(ApiError):
    status, kind = 400, "invalid_request_error"


class Unauthorized(ApiError):
    status, kind = 401, "authentication_error"


class Forbidden(ApiError):
    status, kind = 403, "permission_error"


class NotFound(ApiError):
    status, kind = 404, "not_found_error"


class Conflict(ApiError):
    status, kind = 409, "conflict_error"


class HeldElsewhere(Conflict):
    """A session that another live server on the shared --kv-disk holds. `holder` is that server's boot id,
    where its claim names one: a server with --peers sends the request there (server/api/peers.py)."""

    def __init__(self, message: str, holder: str | None, param: str | None = None) -> None:
        super().__init__(message, param, {"Retry-After": "1"})
        self.holder = holder


class PayloadTooLarge(ApiError):
    status, kind = 413, "invalid_request_error"


class Overloaded(ApiError):
    """The server is full for now: the answer says when to try again."""

    status, kind = 429, "rate_limit_error"

    def __init__(self, message: str, param: str | None = None, retry_after_s: int = 1) -> None:
        super().__init__(message, param, {"Retry-After": str(retry_after_s)})


class TimedOut(ApiError):
    """The request's deadline (its `timeout`, or --request-timeout) passed before it started running: the
    client's own limit, so a 4xx (schema fuzzers and proxies read a 5xx as the server's fault)."""

    status, kind = 408, "timeout_error"


class ShuttingDown(ApiError):
    status, kind = 503, "unavailable_error"


class StepFailed(ApiError):
    status, kind = 500, "server_error"


class NotSupported(ApiError):
    """A route of another server's API that kvserve does not implement (Ollama's model management)."""

    status, kind = 501, "not_implemented_error"
