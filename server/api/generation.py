"""What every generation route does: pick the session, submit, then stream or collect the events."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request as HttpRequest

from ..engine.engine import Engine
from ..engine.sampling import SamplingParams
from ..engine.sequence import Finished, Scheduling, Sequence, TokenEvent
from ..errors import ApiError, InvalidRequest, NotFound, quoted
from . import model_names
from .output_stream import OutputStream


log = logging.getLogger("kvserve.api")
DISCONNECT_POLL_S = 0.25  # how often a non-streaming handler asks whether its client is still there


def engine_of(http: HttpRequest) -> Engine:
    return http.app.state.engine


def owner_of(http: HttpRequest) -> str | None:
    return getattr(http.state, "owner", None)


def check_model(http: HttpRequest, model: str | None) -> None:
    """A served name or alias, with or without `:latest` (model_names.py); the empty string means the served
    model, as vLLM reads it, and "tgi" too, which TGI's clients send to its OpenAI routes."""
    config = http.app.state.config
    if model is not None and model not in ("", "tgi") and model_names.resolve(config, model) is None:
        raise NotFound(f"the model {quoted(model)} does not exist; this server serves {config.model_name!r}",
                       param="model")


def check_stops(http: HttpRequest, stop: tuple[str, ...], param: str, noun: str = "stop strings") -> None:
    """A request may name at most --max-stop-strings stop strings (the OutputStream matches each on every piece)."""
    limit = engine_of(http).config.max_stop_strings
    if len(stop) > limit:
        raise InvalidRequest(f"at most {limit} {noun} are allowed", param=param)


def session_id_of(http: HttpRequest, body_session: str | None) -> str | None:
    return body_session or http.headers.get("x-session-id") or None


def start(
    http: HttpRequest,
    session_id: str | None,
    prompt: list[int],
    params: SamplingParams,
    *,
    resend: bool,
    n: int = 1,
    scheduling: Scheduling = Scheduling(),
) -> list[Sequence]:
    """Submit to the engine, on the named session or on temporary ones removed when done; n > 1 runs
    n choices, each on a temporary session, the prompt prefilled once and forked."""
    engine = engine_of(http)
    owner = owner_of(http)
    if session_id is None:
        # choice i draws from seed + i: each choice is reproducible, and the choices differ
        choices = [params if params.seed is None else dataclasses.replace(params, seed=(params.seed + i) % 2**63)
                   for i in range(n)]
        return engine.submit_temporary(prompt, choices, owner, scheduling)
    if n > 1:
        raise InvalidRequest("n > 1 runs each choice on a temporary session; send it without a session id", param="n")
    with engine.lock:  # a session another server left on the shared --kv-disk joins the store here
        session = engine.session(session_id, owner)
    return [engine.submit(session, prompt, params, resend, scheduling)]


def output_stream(engine: Engine, req: Sequence) -> OutputStream:
    """The request's text, with the one handle through which a stop string ends it."""
    return OutputStream(engine.tokenizer, req, functools.partial(engine.cut, req))


async def events(http: HttpRequest, req: Sequence, watch_disconnect: bool) -> AsyncIterator[TokenEvent | Finished]:
    """Yield the request's events, as text, until it finishes; a client that goes away cancels it."""
    engine = engine_of(http)
    output = output_stream(engine, req)
    getter: asyncio.Task | None = None
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        # A streaming response learns of a gone client from its own send, so it awaits the queue
        # directly: no task and asyncio.wait per token on the event loop, which competes with the
        # model thread for the GIL.
        while not watch_disconnect:
            event = output.render(await req.events.get())
            if event is not None:
                yield event
            if isinstance(event, Finished):
                return
        while True:
            getter = getter or asyncio.ensure_future(req.events.get())
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            # events may arrive faster than the poll interval, so look at the clock, not at timeouts
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await http.is_disconnected():
                    return
            if not done:
                continue
            event, getter = output.render(getter.result()), None
            if event is not None:
                yield event
            if isinstance(event, Finished):
                return
    finally:
        if getter is not None:
            getter.cancel()
        engine.cancel(req)


async def collect(http: HttpRequest, req: Sequence) -> tuple[list[TokenEvent], Finished]:
    """Run a non-streaming request to its end (cancelling it if the client disconnects)."""
    tokens: list[TokenEvent] = []
    async for event in events(http, req, watch_disconnect=True):
        if isinstance(event, Finished):
            raise_if_failed(event)
            return tokens + ([event.last] if event.last is not None else []), event
        tokens.append(event)
    raise ClientGone("client disconnected")


class ClientGone(asyncio.CancelledError):
    """A non-streaming request whose client left before its answer: the request is cancelled and nobody is
    left to answer, so the handler unwinds as a cancellation does (ClientGoneLog logs it)."""


class ClientGoneLog:
    """Outermost but for Starlette's error page: a client that left (timed out, say) is one log line, not the
    traceback uvicorn gives any exception that leaves the app."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        except ClientGone:
            log.info("%s %s: the client disconnected before its answer", scope.get("method"), scope.get("path"))


async def merged(http: HttpRequest, reqs: list[Sequence]) -> AsyncIterator[tuple[int, TokenEvent | Finished]]:
    """The events of several requests (the choices of one), as (choice index, event), until all finish."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, req: Sequence) -> None:
        async for event in events(http, req, watch_disconnect=False):
            queue.put_nowait((i, event))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        running = len(reqs)
        while running:
            i, event = await queue.get()
            yield i, event
            running -= isinstance(event, Finished)
    finally:
        for task in tasks:
            task.cancel()  # each pump's events() then cancels its request


def raise_if_failed(finished: Finished) -> None:
    if finished.error is not None:
        raise finished.error if isinstance(finished.error, ApiError) else ApiError(str(finished.error))


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_error(error: Exception | None) -> str:
    err = error if isinstance(error, ApiError) else ApiError(str(error))
    return sse(err.body())


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
