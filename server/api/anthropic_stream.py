"""A reply in Anthropic's shape: stop reasons, usage and errors, and the SSE event grammar of a streamed one.

A stream is `message_start`, `ping`, then content blocks, each `content_block_start`, its deltas
(`thinking_delta` and a last `signature_delta` for a thinking block, `text_delta`, or `input_json_delta` for
a tool_use block's input, while it is generated) and `content_block_stop`; then `message_delta` (the stop reason and usage) and `message_stop`. A failure
midway is an `error` event, which the SDKs raise as the status error its type names.
"""
from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import AsyncIterator

from fastapi import Request as HttpRequest

from ..engine.sequence import Finished, Sequence, TokenEvent
from ..errors import ApiError
from . import generation
from .anthropic_schemas import ThinkingConfig
from .reply import ReplyReader

# "timeout": its deadline passed while it ran (as the OpenAI routes say; Anthropic has no such reason)
STOP_REASONS = {"eos": "end_turn", "stop": "stop_sequence", "length": "max_tokens", "cancelled": "max_tokens",
                "timeout": "timeout", "error": "end_turn",
                # the server's drain ended it mid-turn: Anthropic's reason for a turn that stopped early and
                # may be sent back as-is to continue (which a restarted server or another replica does)
                "shutdown": "pause_turn",
                "unmet": "max_tokens"}  # its grammar allowed nothing more: the output is incomplete
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(err: Exception) -> dict:
    """An error as Anthropic's API gives it: its type by status, a 5xx of its own an api_error."""
    status, message = (err.status, err.message) if isinstance(err, ApiError) else (500, str(err))
    kind = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def stop_reason(reason: str, complete_calls: int) -> str:
    """A reply with complete tool calls stops for them, unless max_tokens or its deadline cut it."""
    return "tool_use" if complete_calls and reason not in ("length", "cancelled", "timeout") else STOP_REASONS[reason]


def ending(tokenizer, req: Sequence, f: Finished, complete_calls: int, reader: ReplyReader) -> tuple[str, str | None]:
    """The reply's stop reason and the stop sequence that ended it, if one did. A stop its format added (the
    markers that end a gpt-oss reply, where they are no EOS token) is its end of turn, not the client's stop."""
    reason = stop_reason(f.reason, complete_calls)
    stop = matched_stop(tokenizer, req, f) if reason == "stop_sequence" else None
    if reader.channels and stop in reader.format.ends:
        return "end_turn", None
    return reason, stop


def matched_stop(tokenizer, req: Sequence, f: Finished) -> str | None:
    """Which stop sequence ended the reply: the output was cut just before it, and the request's tokens
    still hold it (the token that completed it is kept)."""
    if f.reason != "stop":
        return None
    full, stops = tokenizer.decode(req.output_ids), req.params.stop
    here = [s for s in stops if full.startswith(s, len(f.output))]
    if here:
        return min(here, key=len)  # of two that start here, the shorter one completed first
    found = sorted((full.find(s), len(s), s) for s in stops if s in full)
    return found[0][2] if found else None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic counts input_tokens apart from those read from the cache (here, the prefix cache)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def message(http: HttpRequest, content: list[dict], reason: str | None, stop: str | None, use: dict) -> dict:
    return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
            "model": http.app.state.config.model_name, "content": content, "stop_reason": reason,
            "stop_sequence": stop, "usage": use}


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def signature(thinking: str) -> str:
    """A thinking block's signature. kvserve does not sign (a client's thinking blocks are taken as sent): this
    is a digest of the thinking, so that clients that keep and send back signatures find one."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload}, ensure_ascii=False)}\n\n"


class MessageStream:
    """Turns one request's engine events into Anthropic's stream events."""

    def __init__(self, http: HttpRequest, req: Sequence, reader: ReplyReader, thinking: ThinkingConfig | None) -> None:
        self.http, self.req = http, req
        self.reader, self.reply = reader, reader.stream()
        self.shows_thinking = thinking is not None and thinking.on  # asked for: else a think block is dropped
        self.omits_thinking = thinking is not None and thinking.display == "omitted"
        self.thought = ""  # the open thinking block's thinking, for its signature
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the type of the block now open, if one is

    async def __aiter__(self) -> AsyncIterator[str]:
        started = False
        async for ev in generation.events(self.http, self.req, watch_disconnect=False):
            if not started:  # by the first event the request is admitted: its cached tokens are known
                started = True
                use = usage(self.req.prompt_tokens, self.req.cached_tokens, 0)
                yield event("message_start", {"message": message(self.http, [], None, None, use)})
                yield event("ping", {})
            if isinstance(ev, TokenEvent):
                for out in self._feed(ev.text):
                    yield out
                continue
            if ev.error is not None:
                yield event("error", {"error": error_body(ev.error)["error"]})
                return
            for out in self._end(ev):
                yield out

    def _feed(self, text: str) -> list[str]:
        reasoning, content, deltas = self.reply.feed(text)
        # thinking comes first, and text in the same piece only ever follows the calls
        return self._thinking(reasoning) + self._tools(deltas) + self._text(content)

    def _end(self, f: Finished) -> list[str]:
        out = self._feed((f.last.text if f.last is not None else "") + f.text)
        reasoning, content, deltas = self.reply.finish()
        out += self._thinking(reasoning) + self._text(content) + self._tools(deltas)
        out += self._close()
        reason, stop = ending(self.http.app.state.engine.tokenizer, self.req, f, self.reply.complete, self.reader)
        out.append(event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                           "usage": usage(f.prompt_tokens, f.cached_tokens, f.completion_tokens)}))
        out.append(event("message_stop", {}))
        return out

    def _thinking(self, thinking: str) -> list[str]:
        if not thinking or not self.shows_thinking:
            return []
        out = [] if self.open == "thinking" else self._start({"type": "thinking", "thinking": "", "signature": ""})
        self.thought += thinking
        if not self.omits_thinking:
            out.append(event("content_block_delta", {"index": self.blocks - 1,
                                                     "delta": {"type": "thinking_delta", "thinking": thinking}}))
        return out

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        out = [] if self.open == "text" else self._start({"type": "text", "text": ""})
        out.append(event("content_block_delta", {"index": self.blocks - 1, "delta": {"type": "text_delta", "text": text}}))
        return out

    def _tools(self, deltas: list[dict]) -> list[str]:
        """OpenAI-shaped call deltas (tool_stream.py): one with an id begins a call, the rest carry its input."""
        out = []
        for d in deltas:
            if "id" in d:
                out += self._start({"type": "tool_use", "id": tool_use_id(), "name": d["function"]["name"], "input": {}})
            piece = d["function"].get("arguments") or ""
            if piece:
                out.append(event("content_block_delta", {"index": self.blocks - 1,
                                                         "delta": {"type": "input_json_delta", "partial_json": piece}}))
        return out

    def _start(self, block: dict) -> list[str]:
        out = self._close()
        out.append(event("content_block_start", {"index": self.blocks, "content_block": block}))
        self.blocks, self.open = self.blocks + 1, block["type"]
        return out

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # its signature comes last, just before the block's end
            out.append(event("content_block_delta", {"index": self.blocks - 1,
                                                     "delta": {"type": "signature_delta",
                                                               "signature": signature(self.thought)}}))
            self.thought = ""
        self.open = None
        return out + [event("content_block_stop", {"index": self.blocks - 1})]
