"""Session routes: create, inspect, fork, rewind, snapshot and end conversations whose KV stays resident."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi import Request as HttpRequest

from . import generation, session_history
from .schemas import ERROR_RESPONSES
from .sessions_schemas import SessionCreate, SessionFork, SessionRewind

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERROR_RESPONSES)


@router.post("")
async def create_session(http: HttpRequest, body: SessionCreate | None = None) -> dict:
    body = body or SessionCreate()
    engine = generation.engine_of(http)
    # behind a load balancer that hashes X-Session-Id, the client picks the id it will route on
    chosen = body.id or http.headers.get("x-session-id")
    session = engine.create_session(body.capacity, body.sizing, generation.owner_of(http), session_id=chosen)
    with engine.lock:
        return {"object": "session", **session.info()}


@router.get("")
async def list_sessions(http: HttpRequest) -> dict:
    owner, engine = generation.owner_of(http), generation.engine_of(http)
    with engine.lock:  # the step loop changes sessions and their caches under it
        sessions = [s.info() for s in engine.sessions if s.persistent and s.owned_by(owner)]
    return {"object": "list", "data": sessions}


@router.get("/{session_id}")
async def get_session(session_id: str, http: HttpRequest) -> dict:
    """Its figures and its history (`text`, and `messages` where it is a chat in the model's template), so a
    client can show the conversation and continue it by resending the messages with a new turn."""
    engine = generation.engine_of(http)
    with engine.lock:
        session = engine.session(session_id, generation.owner_of(http))
        info, tokens = session.info(), list(session.tokens)
    return {"object": "session", **info, **session_history.history(engine.tokenizer, tokens)}


@router.delete("/{session_id}")
async def delete_session(session_id: str, http: HttpRequest) -> dict:
    engine = generation.engine_of(http)
    with engine.lock:
        session = engine.session(session_id, generation.owner_of(http))
    engine.delete_session(session)
    return {"id": session_id, "object": "session", "deleted": True}


@router.post("/{session_id}/rewind")
async def rewind_session(session_id: str, body: SessionRewind, http: HttpRequest) -> dict:
    engine = generation.engine_of(http)
    with engine.lock:
        session = engine.session(session_id, generation.owner_of(http))
    engine.rewind_session(session, body.length)
    with engine.lock:
        return {"object": "session", **session.info()}


@router.post("/{session_id}/fork")
async def fork_session(session_id: str, http: HttpRequest, body: SessionFork | None = None) -> dict:
    """A new session with this one's history; the two share KV blocks until either writes into one."""
    engine = generation.engine_of(http)
    owner = generation.owner_of(http)
    with engine.lock:
        parent = engine.session(session_id, owner)
    child = engine.fork_session(parent, owner, session_id=body.id if body is not None else None)
    with engine.lock:
        return {"object": "session", "parent": parent.id, **child.info()}


@router.post("/{session_id}/snapshot")
async def snapshot_session(session_id: str, http: HttpRequest) -> dict:
    """Write the session's record and its blocks to the disk tier now (--kv-disk), and wait until they are there."""
    engine = generation.engine_of(http)
    with engine.lock:
        session = engine.session(session_id, generation.owner_of(http))
    on_disk = await asyncio.to_thread(engine.snapshot, session)
    with engine.lock:
        return {"object": "session", "on_disk": on_disk, **session.info()}
