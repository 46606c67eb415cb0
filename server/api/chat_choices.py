"""A chat completion's choices from its replies, as a ReplyReader reads them (reply.py): the whole message,
or a streamed one's deltas: `reasoning_content` (vLLM's field for a think block), `content` and
`tool_calls`, each only where there is some."""
from __future__ import annotations

from collections.abc import Callable

from ..engine.sequence import Finished, TokenEvent
from .choice_stream import OPENAI_REASONS
from .reply import Reply, ReplyReader


def finish_reason(reason: str, calls: int) -> str:
    """A reply with complete tool calls finishes with tool_calls, unless max_tokens or its deadline cut it."""
    return "tool_calls" if calls and reason not in ("length", "timeout") else OPENAI_REASONS[reason]


def delta(reasoning: str, content: str | None, tool_calls: list[dict]) -> dict:
    return {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": content} if content else {}),
            **({"tool_calls": tool_calls} if tool_calls else {})}


def message(reader: ReplyReader, reply: Reply) -> dict:
    """The reply as a chat message; a model that thinks always has reasoning_content (null where it did not)."""
    out = {"role": "assistant", "content": reply.content}
    if reader.thinks:
        out["reasoning_content"] = reply.reasoning
    return {**out, "tool_calls": reply.calls} if reply.calls else out


class StreamedChoices:
    """make_choice and make_final of a ChoiceStream (choice_stream.py) for a chat's choices."""

    def __init__(self, reader: ReplyReader, n: int, logprobs: Callable[[TokenEvent], dict]) -> None:
        self.streams = [None if reader.plain else reader.stream() for _ in range(n)]
        self.logprobs = logprobs

    def choice(self, i: int, text: str | None, event: TokenEvent | None, reason: str | None, first: bool = False):
        if first:
            return {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        reasoning, deltas, stream = "", [], self.streams[i]
        if stream is not None:
            reasoning, text, deltas = stream.feed(text or "")
        if not reasoning and not text and not deltas and event is None and reason is None:
            return None
        lp = self.logprobs(event) if event is not None else None
        return {"index": i, "delta": delta(reasoning, text, deltas), "logprobs": lp, "finish_reason": reason}

    def final(self, i: int, f: Finished) -> list[dict]:
        stream = self.streams[i]
        if stream is None:
            return [self.choice(i, f.text, None, OPENAI_REASONS[f.reason])]
        last = self.choice(i, f.text, None, None)
        held = delta(*stream.finish())
        out = [c for c in (last, {"index": i, "delta": held, "logprobs": None, "finish_reason": None} if held else None) if c]
        return [*out, {"index": i, "delta": {}, "logprobs": None, "finish_reason": finish_reason(f.reason, stream.complete)}]
