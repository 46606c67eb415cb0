"""How to read a reply: its think block (reasoning.py) first, then its tool calls in the model's format
(tool_formats/), whole or piece by piece as it streams; or, for a format of channels (gpt-oss's harmony),
its reasoning, content and calls all by that format. Every dialect reads its replies through this."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..engine.sampling import SamplingParams
from .reasoning import ReasoningStream
from .tool_formats import ToolFormat, hermes
from .tool_formats.base import Offered


@dataclass(frozen=True)
class Reply:
    reasoning: str | None  # None: no think block, or an empty one
    content: str | None  # None: calls only, or a reply that never left its think block
    calls: list[dict]  # complete calls, OpenAI-shaped
    reasoning_tokens: int = 0  # pieces (tokens, when fed one each) that made the think block


@dataclass(frozen=True)
class ReplyReader:
    """How to read the reply to one prompt (chat_render.py makes it from the model's chat template)."""

    thinks: bool = False  # the template has think blocks: they are split off the reply
    opened: bool = False  # the prompt ended inside one
    names: Offered = field(default_factory=dict)  # the functions the reply may call (none: no calls are read)
    forced: bool = False  # a forced tool_choice's grammar wrote the reply: calls only, in the model's format
    format: ToolFormat = hermes.FORMAT  # the format of the model's own calls

    @property
    def channels(self) -> bool:
        """Whether the reply is read by its format's channels."""
        return self.format.channels is not None

    @property
    def plain(self) -> bool:
        """Whether the reply is all content, as it came."""
        return not self.thinks and not self.names and not self.channels

    def constrained(self) -> ReplyReader:
        """A grammar writes the reply from its first token: it cannot be inside a think block the prompt opened."""
        return dataclasses.replace(self, opened=False)

    def sampling(self, params: SamplingParams) -> SamplingParams:
        if self.forced:  # wanted whole (or refused if it cannot fit), and a call said again ends the reply before it
            params = dataclasses.replace(params, whole_output=True, stop_repeats=self.format.call_end)
        if self.channels:  # its markers stay in the text, and those that end generation end the reply there
            ends = tuple(s for s in self.format.ends if s not in params.stop)
            return dataclasses.replace(params, skip_special_tokens=False, stop=params.stop + ends)
        keep = bool(self.names) and self.format.keeps_special_tokens
        return dataclasses.replace(params, skip_special_tokens=False) if keep else params

    def _calls(self) -> ToolFormat:
        return hermes.FORCED if self.forced and self.format is hermes.FORMAT else self.format

    def parse(self, pieces: list[str]) -> Reply:
        """A whole reply, from its text in the pieces it came in (its tokens', to count the reasoning's), or in one."""
        if self.channels:
            return self._channels(pieces)
        thought = ReasoningStream(self.opened) if self.thinks else None
        if thought is None:
            reasoning, content = "", "".join(pieces)
        else:
            split = [thought.feed(piece) for piece in pieces] + [thought.finish()]
            reasoning, content = "".join(r for r, _ in split), "".join(c for _, c in split)
        calls = []
        if self.names:
            content, calls = self._calls().parse(content, self.names)
        if thought is not None and thought.had_block and not content:
            content = None  # a reply that never left its block (or said nothing after it)
        return Reply(reasoning or None, content, calls, thought.reasoning_pieces if thought is not None else 0)

    def _channels(self, pieces: list[str]) -> Reply:
        stream = self.format.channels(self.names)
        parts = [stream.feed(piece) for piece in pieces] + [stream.finish()]
        reasoning, content = "".join(p[0] for p in parts), "".join(p[1] for p in parts)
        calls = [{k: v for k, v in d.items() if k != "index"} for p in parts for d in p[2]]
        return Reply(reasoning or None, content or None, calls, stream.reasoning_pieces)

    def stream(self) -> ReplyStream:
        return ReplyStream(self)


class ReplyStream:
    """Feeds on a reply's text, a token's piece at a time; gives (reasoning, content, call deltas) to send."""

    def __init__(self, reader: ReplyReader) -> None:
        self.channels = reader.format.channels(reader.names) if reader.channels else None
        self.thought = ReasoningStream(reader.opened) if reader.thinks and self.channels is None else None
        self.calls = reader._calls().stream(reader.names) if reader.names and self.channels is None else None

    @property
    def complete(self) -> int:
        """Complete calls so far."""
        reading = self.channels if self.channels is not None else self.calls
        return reading.complete if reading is not None else 0

    @property
    def reasoning_tokens(self) -> int:
        if self.channels is not None:
            return self.channels.reasoning_pieces
        return self.thought.reasoning_pieces if self.thought is not None else 0

    def feed(self, text: str) -> tuple[str, str, list[dict]]:
        if self.channels is not None:
            return self.channels.feed(text)
        reasoning, content = self.thought.feed(text) if self.thought is not None else ("", text)
        if self.calls is None:
            return reasoning, content, []
        return (reasoning, *self.calls.feed(content))

    def finish(self) -> tuple[str, str, list[dict]]:
        if self.channels is not None:
            return self.channels.finish()
        reasoning, content = self.thought.finish() if self.thought is not None else ("", "")
        if self.calls is None:
            return reasoning, content, []
        content, deltas = self.calls.feed(content)
        rest, more = self.calls.finish()
        return reasoning, content + rest, deltas + more
