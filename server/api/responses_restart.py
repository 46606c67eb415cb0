"""A stored response whose server died while it ran: it reads as `incomplete`, never as `in_progress` forever.

A stored response is written `in_progress` when its run starts and again when it ends (responses.py), so a
server killed in between (kill -9, a crash, the power) leaves the first record on the disk tier. Every
record names the server process that wrote it (its boot id, app.state.instance_id): one still in progress
under another process's id was cut when that process died, since a run never outlives its process.

It becomes `incomplete`, reason "server_restarted", rather than `failed`: OpenAI clients treat both as final,
but `incomplete` is the status of a reply that was cut short and whose conversation goes on (OpenAI's own
max_output_tokens cut), and `failed`'s error codes name request errors, none of which is this. Its output
stays what was stored (nothing of a run is stored before its end), so the reply's loss is visible, and a
`previous_response_id` naming it continues from the conversation that was kept: its input, no reply. That is
what a session (X-Session-Id, session_id) does too: it continues from the history its record kept.
"""
from __future__ import annotations

from fastapi import Request as HttpRequest

from ..engine.session import Session
from . import generation

RESTARTED = "server_restarted"


def settled(meta: dict, instance_id: str) -> dict | None:
    """The meta to keep instead of a stored response's `meta` whose run died with its server; None if it stands."""
    response = meta["response"]
    if response.get("status") != "in_progress" or meta.get("server") == instance_id:
        return None
    response = {**response, "status": "incomplete", "incomplete_details": {"reason": RESTARTED}, "usage": None}
    return {**meta, "response": response, "server": instance_id}


def settle(http: HttpRequest, session: Session) -> Session:
    """A stored response's session as it stands: one whose run died with its server reads as incomplete, and
    is stored so."""
    engine = generation.engine_of(http)
    with engine.lock:  # the step loop writes the session's record under it
        meta = session.meta and settled(session.meta, http.app.state.instance_id)
        if meta:
            session.meta = meta
            engine.pool.persist(session)
    return session
