"""OpenAI's Responses API (`POST /v1/responses`), stateful through sessions.

A stored response (store=true, the default) IS a persistent session, under the response's own id: the
session holds the conversation's KV (prompt and output) and, in its `meta`, the response object and the
conversation as items. So stored responses follow sessions' quotas, expiry and disk tier, and another
key cannot see them. `previous_response_id` forks the previous response's session (a fork shares its KV
blocks: one response continued twice gives two independent branches) and sends the whole conversation,
re-rendered from its items, with resend: the engine keeps the common prefix of its KV, so only the new
turn is prefilled, and the prompt is exactly the one a fresh request over the whole conversation sends.
As OpenAI does, a previous response's `instructions` are not carried over.

A model that thinks gives a `reasoning` item (its think block, as reasoning_text content) before its
message, and its tokens are counted as reasoning tokens; `reasoning.effort` "none" turns thinking off.
"""
from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import Future
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from fastapi import APIRouter, Query
from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from ..engine.sequence import Finished, Sequence, TokenEvent
from ..engine.session import Session
from ..errors import NotFound, quoted
from . import chat_render, chat_template, generation, openai, tools
from .reply import ReplyReader
from .responses_chat import chat_request
from .responses_errors import ERROR_RESPONSES
from .responses_items import check_call_outputs, input_items
from .responses_records import is_stored_response
from .responses_restart import settle
from .responses_schemas import NamedFunction, ResponseRequest
from .responses_stream import ResponseEvents, call_item, message_item, new_id, reasoning_item

router = APIRouter(prefix="/v1/responses", tags=["responses"], responses=ERROR_RESPONSES)
log = logging.getLogger("kvserve.responses")

INCOMPLETE = {"length": "max_output_tokens", "timeout": "timeout", "cancelled": "cancelled", "unmet": "constraint_unmet",
              "shutdown": "server_shutdown"}


@dataclass
class _Run:
    """One response from its request to its stored end."""

    http: HttpRequest
    body: ResponseRequest
    history: list[dict]  # the conversation before this turn (the previous response's)
    turn: list[dict]  # this turn's input items
    reader: ReplyReader = ReplyReader()  # how its reply is read: think block, and calls of the functions offered
    id: str = field(default_factory=lambda: new_id("resp_"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    session: Session | None = None
    reasoning_tokens: int = 0  # of its output, once read
    saved: Future | None = None  # its last record's write to the disk tier

    def response(self, status: str, output: list[dict], f: Finished | None = None, error: str | None = None) -> dict:
        body = self.body
        fmt = {"type": "text"}
        if body.text is not None and body.text.format is not None:
            fmt = body.text.format.model_dump(by_alias=True, exclude_none=True)
        choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": {"code": "server_error", "message": error} if error is not None else None,
            "incomplete_details": {"reason": INCOMPLETE.get(f.reason, f.reason)} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.http.app.state.config.model_name, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": body.reasoning.summary if body.reasoning else None}, "store": body.store,
            "temperature": body.temperature if body.temperature is not None else 1.0,
            "text": {"format": fmt}, "tool_choice": choice or "auto",
            "tools": [t.model_dump() for t in body.tools or []],
            "top_p": body.top_p if body.top_p is not None else 1.0, "truncation": "disabled",
            "top_logprobs": body.top_logprobs,
            "usage": _usage(f, self.reasoning_tokens) if f is not None and f.error is None else None,
            "user": body.user, "metadata": body.metadata or {},
        }

    def end(self, f: Finished | None, output: list[dict], status: str | None = None, error: str | None = None) -> dict:
        """The response as it ended, stored with its conversation when it is stored."""
        status = status or ("incomplete" if f.reason in INCOMPLETE else "completed")
        out = self.response(status, output, f, error)
        self.saved = self.store(out, output)
        return out

    async def on_disk(self) -> None:
        """Wait until the ended response's record is on the disk tier (where it has one): once a client
        reads a stored response, a kill -9 cannot take it back to in_progress."""
        if self.saved is not None:
            await asyncio.wrap_future(self.saved)

    def store(self, response: dict, output: list[dict]) -> Future | None:
        if self.session is None:
            return None
        engine = generation.engine_of(self.http)
        start = len(self.history)
        meta = {"response": response, "conversation": [*self.history, *self.turn, *output],
                "input": [start, start + len(self.turn)],
                "server": self.http.app.state.instance_id}  # which process ran it (responses_restart.py)
        with engine.lock:  # the step loop writes the session's record under it
            self.session.meta = meta
            return engine.pool.persist(self.session)


def _usage(f: Finished, reasoning_tokens: int) -> dict:
    return {"input_tokens": f.prompt_tokens, "input_tokens_details": {"cached_tokens": f.cached_tokens},
            "output_tokens": f.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": f.prompt_tokens + f.completion_tokens}


def _stored(http: HttpRequest, response_id: str, param: str = "response_id") -> Session:
    """A stored response's session, for this caller (another key's is missing, as sessions are)."""
    engine = generation.engine_of(http)
    try:
        with engine.lock:
            session = engine.session(response_id, generation.owner_of(http))
    except NotFound:
        session = None
    meta = session.meta if session is not None else None
    if meta and not is_stored_response(meta, session.id):  # a record edited or damaged on the disk tier
        log.warning("stored response %s: its record does not hold a stored response; read as missing",
                    quoted(response_id))
        with engine.lock:
            if session.meta is meta:  # warned once: from now on it is a session like any other
                session.meta = None
        meta = None
    if not meta:
        raise NotFound(f"no stored response {quoted(response_id)}: it never existed, was deleted, expired, was not "
                       "stored (store=false), or belongs to another key", param=param)
    return settle(http, session)  # one whose run died with its server reads as incomplete


async def _start(run: _Run, previous: Session | None) -> Sequence:
    http, body = run.http, run.body
    engine = generation.engine_of(http)
    chat = chat_request(body, [*run.history, *run.turn], chat_template.thinks(engine.tokenizer))
    rendered = chat_render.render_chat(engine.tokenizer, chat)
    prompt = rendered.ids
    forced = tools.forced_tools(chat)
    grammar = await asyncio.to_thread(openai.output_grammar, engine.grammars, chat, forced,  # compiles: off the loop
                                      rendered.reader.format.forced)
    vocab = engine.model.config.vocab_size
    run.reader = rendered.reader if grammar is None else rendered.reader.constrained()
    params = run.reader.sampling(openai.openai_params(chat, body.max_output_tokens, body.logprobs, vocab, grammar))
    if not body.store:
        return generation.start(http, None, prompt, params, resend=True)[0]
    owner = generation.owner_of(http)
    if previous is None:
        run.session = engine.create_session(None, None, owner, session_id=run.id)
    else:
        run.session = engine.fork_session(previous, owner, session_id=run.id)
    run.store(run.response("in_progress", []), [])
    try:
        return engine.submit(run.session, prompt, params, resend=True)
    except Exception:
        engine.delete_session(run.session)
        raise


@router.post("")
async def create_response(body: ResponseRequest, http: HttpRequest):
    generation.check_model(http, body.model)
    history, previous = [], None
    if body.previous_response_id is not None:
        previous = _stored(http, body.previous_response_id, "previous_response_id")
        history = previous.meta["conversation"]
    run = _Run(http, body, history, input_items(body.input))
    check_call_outputs(history, run.turn)
    req = await _start(run, previous)
    if body.stream:
        return StreamingResponse(_stream(run, req), media_type="text/event-stream", headers=generation.SSE_HEADERS)
    try:
        tokens, f = await generation.collect(http, req)
    except asyncio.CancelledError:  # the client went away
        run.end(None, [], "cancelled")
        raise
    except Exception as e:
        run.end(None, [], "failed", str(e))
        raise
    final = run.end(f, _output(f, run, tokens))
    await run.on_disk()
    return final


def _logprobs(run: _Run, tokens: list[TokenEvent]) -> list[dict]:
    """The tokens' logprobs in OpenAI's shape (the chat route's), less an end token's: it shows no text."""
    tok = generation.engine_of(run.http).tokenizer
    return openai._chat_logprobs(tok, [t for t in tokens if not t.ends_text])["content"]


def _output(f: Finished, run: _Run, tokens: list[TokenEvent]) -> list[dict]:
    """A whole reply as output items: its reasoning, its text as a message, and its complete calls (one cut
    short is dropped). The text carries its logprobs if asked, where its tokens are all text (ResponseEvents)."""
    status = "incomplete" if f.reason in INCOMPLETE else "completed"
    reply = run.reader.parse([t.text for t in tokens] + [f.text])
    run.reasoning_tokens = reply.reasoning_tokens
    scores = _logprobs(run, tokens) if run.body.logprobs is not None and run.reader.plain else None
    kept = reply.content is not None or not (reply.calls or run.reader.forced or reply.reasoning)
    closed = reply.content is not None or bool(reply.calls)  # the think block ended before the reply did
    items = [reasoning_item(reply.reasoning, "completed" if closed else status, summarised=_summarised(run))
             ] if reply.reasoning else []
    items += [message_item(reply.content or "", status, logprobs=scores)] if kept else []
    return items + [call_item(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in reply.calls]


def _summarised(run: _Run) -> bool:
    r = run.body.reasoning
    return r is not None and (r.summary or r.generate_summary) is not None


async def _stream(run: _Run, req: Sequence) -> AsyncIterator[str]:
    events = ResponseEvents(run.reader, run.body.logprobs is not None, _summarised(run))
    scored = events.scored
    start = run.response("in_progress", [])
    yield events.event("response.created", response=start)
    yield events.event("response.in_progress", response=start)
    ended = False
    try:
        async for event in generation.events(run.http, req, watch_disconnect=False):
            if isinstance(event, TokenEvent):
                for chunk in events.feed(event.text, _logprobs(run, [event]) if scored else []):
                    yield chunk
                continue
            if event.error is not None:
                ended = True
                failed = run.end(event, events.output(), "failed", str(event.error))
                yield events.event("response.failed", response=failed)
                return
            last = [event.last] if event.last is not None else []
            tail = "".join(t.text for t in last) + event.text
            for chunk in events.feed(tail, _logprobs(run, last) if scored else []):
                yield chunk
            status = "incomplete" if event.reason in INCOMPLETE else "completed"
            for chunk in events.finish(status):
                yield chunk
            run.reasoning_tokens = events.reasoning_tokens
            ended = True
            final = run.end(event, events.output(), status)
            await run.on_disk()
            yield events.event(f"response.{status}", response=final)
    finally:
        if not ended:  # the client went away: what was streamed stays stored
            run.end(None, events.output(), "cancelled")


@router.get("/{response_id}")
async def get_response(response_id: str, http: HttpRequest) -> dict:
    return _stored(http, response_id).meta["response"]


@router.delete("/{response_id}")
async def delete_response(response_id: str, http: HttpRequest) -> dict:
    session = _stored(http, response_id)
    generation.engine_of(http).delete_session(session)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/{response_id}/input_items")
async def list_input_items(response_id: str, http: HttpRequest, order: Literal["asc", "desc"] = "desc",
                           limit: int = Query(20, ge=1, le=100), after: str | None = None) -> dict:
    """This response's own input items (not the conversation before it), newest first unless order=asc."""
    meta = _stored(http, response_id).meta
    start, end = meta["input"]
    items = meta["conversation"][start:end]
    items = items[::-1] if order == "desc" else items
    if after is not None:
        at = next((i for i, item in enumerate(items) if item["id"] == after), None)
        if at is None:
            raise NotFound(f"no input item {quoted(after)} in response {quoted(response_id)}", param="after")
        items = items[at + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}
