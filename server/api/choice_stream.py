"""A streamed OpenAI reply: the engine events of its choices as SSE chunks, and the usage they add up to."""
from __future__ import annotations

import secrets
import time

from ..engine.sequence import Finished, TokenEvent
from . import generation

# "timeout": the request's deadline passed while it ran (its `timeout`, or --request-timeout); "error": also
# where the output constraint allowed nothing more, so the output does not meet it (as vLLM says for a failed request)
# "shutdown": the server's drain ended it; "abort" as vLLM says for a request the server ended (OpenAI has no
# such reason, and its SDKs pass the string through): "length" would tell a client to raise max_tokens and retry here
OPENAI_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "timeout": "timeout", "cancelled": "length",
                  "error": "error", "unmet": "error", "shutdown": "abort"}


def usage(finished: list[Finished], n: int = 1) -> dict:
    """Choices in groups of n per prompt: a prompt's tokens (and its cached part) count once, however many
    choices it has."""
    prompts = finished[::n]
    prompt, completion = sum(f.prompt_tokens for f in prompts), sum(f.completion_tokens for f in finished)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(f.cached_tokens for f in prompts)},
    }


class ChoiceStream:
    """Turns engine events of one request's choices into OpenAI SSE chunks."""

    def __init__(self, http, reqs, body, kind: str, make_choice, want_logprobs: bool, make_final=None,
                 first_waits: bool = False) -> None:
        self.http, self.reqs, self.body, self.make_choice, self.want_logprobs = http, reqs, body, make_choice, want_logprobs
        self.first_waits = first_waits  # a choice's first chunk waits for its first event (what it shows comes then)
        # the last chunks of a choice (by default, its tail text and finish reason)
        self.make_final = make_final or (lambda i, f: [make_choice(i, f.text, None, OPENAI_REASONS[f.reason])])
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        self.object = "chat.completion.chunk" if kind == "chat" else "text_completion"
        self.created, self.model = int(time.time()), http.app.state.config.model_name

    def chunk(self, choices: list, usage: dict | None = None) -> str:
        out = {"id": self.id, "object": self.object, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return generation.sse(out)

    async def _events(self):
        if len(self.reqs) == 1:  # no task per choice on the common path
            async for event in generation.events(self.http, self.reqs[0], watch_disconnect=False):
                yield 0, event
        else:
            async for pair in generation.merged(self.http, self.reqs):
                yield pair

    async def __aiter__(self):
        unopened = set(range(len(self.reqs))) if self.first_waits else set()
        for i in range(len(self.reqs)):
            first = self.make_choice(i, None, None, None, first=True) if i not in unopened else None
            if first is not None:
                yield self.chunk([first])
        finished: list[Finished | None] = [None] * len(self.reqs)
        async for i, event in self._events():
            if i in unopened and (isinstance(event, TokenEvent) or event.error is None):
                unopened.discard(i)
                first = self.make_choice(i, None, None, None, first=True)
                if first is not None:
                    yield self.chunk([first])
            if isinstance(event, TokenEvent):
                choice = self.make_choice(i, event.text, event if self.want_logprobs else None, None)
                if choice is not None:
                    yield self.chunk([choice])
                continue
            if event.error is not None:
                yield generation.sse_error(event.error)
                return
            if event.last is not None:  # the token that ended the choice comes with its end
                choice = self.make_choice(i, event.last.text, event.last if self.want_logprobs else None, None)
                if choice is not None:
                    yield self.chunk([choice])
            finished[i] = event
            for choice in self.make_final(i, event):
                yield self.chunk([choice])
        opts = self.body.stream_options
        if opts is not None and opts.include_usage:
            yield self.chunk([], usage(finished, self.body.n))
        yield generation.sse("[DONE]")
