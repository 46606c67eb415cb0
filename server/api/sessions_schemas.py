"""Bodies of the session routes (/v1/sessions), validated by pydantic."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from .schemas import _Body


class SessionCreate(_Body):
    """`POST /v1/sessions` body."""

    capacity: Annotated[int, Field(gt=0)] | None = None
    sizing: Literal["static", "dynamic"] | None = None
    id: Annotated[str, Field(min_length=22, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")] | None = None


class SessionFork(_Body):
    """`POST /v1/sessions/{id}/fork` body: the new session's id, if the client picks it."""

    id: Annotated[str, Field(min_length=22, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")] | None = None


class SessionRewind(_Body):
    length: Annotated[int, Field(ge=0)]
