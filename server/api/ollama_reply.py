"""One Ollama request's reply as Ollama's objects: its text piece by piece (NDJSON lines), then the end
with its figures; or the whole reply in one object.

The reply is read as every dialect reads it (reply.py): a think block comes back apart, as `thinking`
(the message's in a chat, the object's in a generation), and a chat's tool calls come whole at the end,
their markup held back from the content it streams.
"""
from __future__ import annotations

import datetime
import json
import time

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from ..engine.sequence import Finished, Sequence, TokenEvent
from ..errors import ApiError
from . import generation
from .reply import ReplyReader

# "shutdown": the server's drain ended it ("abort", as the OpenAI routes say; Ollama's done_reason is free text)
REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "timeout", "cancelled": "stop", "error": "stop",
           "shutdown": "abort",
           "unmet": "length"}  # its grammar allowed nothing more: the output is incomplete
NDJSON = "application/x-ndjson"


def error_body(err: ApiError) -> dict:
    """An error in Ollama's shape: the app renders every error under /api/ through this."""
    return {"error": err.message}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _figures(req: Sequence, f: Finished) -> dict:
    """The end's figures, in nanoseconds; load_duration is 0: the model was loaded when the server started."""
    def ns(seconds: float) -> int:
        return max(0, int(seconds * 1e9))

    end = time.monotonic()
    first = req.first_token_at or end
    return {"done_reason": REASONS[f.reason], "total_duration": ns(end - req.arrival), "load_duration": 0,
            "prompt_eval_count": f.prompt_tokens, "prompt_eval_duration": ns(first - (req.admitted_at or req.arrival)),
            "eval_count": f.completion_tokens, "eval_duration": ns((req.last_token_at or first) - first)}


def _ollama_calls(calls: list[dict]) -> list[dict]:
    return [{"function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in calls]


class OllamaReply:
    def __init__(self, http: HttpRequest, req: Sequence, model: str, chat: bool, reader: ReplyReader,
                 prompt: list[int] | None = None) -> None:
        self.http, self.req, self.model, self.chat, self.reader, self.prompt = http, req, model, chat, reader, prompt
        self.stream = None if reader.plain else reader.stream()

    def _object(self, text: str, done: bool, thinking: str = "", tool_calls: list[dict] | None = None) -> dict:
        if self.chat:
            message = {"role": "assistant", "content": text, **({"thinking": thinking} if thinking else {}),
                       **({"tool_calls": tool_calls} if tool_calls else {})}
            return {"model": self.model, "created_at": now(), "message": message, "done": done}
        return {"model": self.model, "created_at": now(), "response": text, **({"thinking": thinking} if thinking else {}),
                "done": done}

    def _end(self, f: Finished, text: str, thinking: str, tool_calls: list[dict]) -> dict:
        out = {**self._object(text, True, thinking, tool_calls), **_figures(self.req, f)}
        if self.prompt is not None:  # /api/generate: the history to send back as `context`, to continue it
            out["context"] = self.prompt + generation.engine_of(self.http).tokenizer.encode(f.output, add_special=False)
        return out

    def whole(self, f: Finished) -> dict:
        reply = self.reader.parse([f.output])
        return self._end(f, reply.content or "", reply.reasoning or "", _ollama_calls(reply.calls))

    def _piece(self, reasoning: str, content: str) -> list[dict]:
        return [self._object(content, False, reasoning)] if reasoning or content else []

    def piece(self, text: str) -> list[dict]:
        if self.stream is None:
            return self._piece("", text)
        reasoning, content, _ = self.stream.feed(text)  # a call's markup is held back: its call comes whole, at the end
        return self._piece(reasoning, content)

    def last(self, f: Finished) -> list[dict]:
        out = self.piece((f.last.text if f.last is not None else "") + f.text)
        if self.stream is not None:
            out += self._piece(*self.stream.finish()[:2])
        calls = self.reader.parse([f.output]).calls if self.reader.names else []
        return [*out, self._end(f, "", "", _ollama_calls(calls))]

    async def lines(self):
        async for event in generation.events(self.http, self.req, watch_disconnect=False):
            if isinstance(event, TokenEvent):
                for obj in self.piece(event.text) if event.text else ():
                    yield line(obj)
                continue
            if event.error is not None:
                err = event.error
                yield line(error_body(err if isinstance(err, ApiError) else ApiError(str(err))))
                return
            for obj in self.last(event):
                yield line(obj)


async def respond(reply: OllamaReply, stream: bool):
    if stream:
        return StreamingResponse(reply.lines(), media_type=NDJSON, headers=generation.SSE_HEADERS)
    _, finished = await generation.collect(reply.http, reply.req)
    return reply.whole(finished)
