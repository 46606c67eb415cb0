"""A request's output as text: its engine events detokenized and cut at its stop strings, off the engine.

The model thread emits token ids only. Like vLLM's output processor, the text is made here, in the
handler, on the event loop: the engine's lock is never held for it. A stop string found here ends the
request through the one handle the stream is given, `end_at(kept)` (the engine's `cut`), which drops
whatever was sampled past the stop from the session. The stream knows nothing else of the engine.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from models.detokenizer import IncrementalDetokenizer

from ..engine.sequence import Finished, Sequence, TokenEvent
from .stops import StopMatcher


class OutputStream:
    """Renders one request's TokenEvents and Finished event into text, in order, ending at a stop string."""

    def __init__(self, tokenizer, req: Sequence, end_at: Callable[[int], None]) -> None:
        self.req, self.end_at = req, end_at  # end_at(kept): end the request after its first `kept` tokens
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=req.params.skip_special_tokens)
        self.stops = StopMatcher(req.params.stop, req.params.stop_repeats)
        self.text = ""
        self.n_tokens = 0
        self.finished: Finished | None = None  # the end, once the stream has decided it

    def render(self, event: TokenEvent | Finished) -> TokenEvent | Finished | None:
        """The event with its text, or None while there is nothing to show.

        A token that completes a stop string ends the reply: the engine is told to cut the request there,
        and the end is given out when the engine's own end arrives, by then with the session's history cut
        back to the stop (a client may send its next request on the session as soon as it has the end)."""
        if isinstance(event, Finished):
            if self.finished is not None and event.error is not None:  # the step failed before the cut: a failure
                self.finished = dataclasses.replace(event, output=self.text)
            elif self.finished is None:
                last = self._token(event.last) if event.last is not None else None
                if self.stops.stopped and event.reason == "length":
                    event = dataclasses.replace(event, reason="stop")  # its last token completed a stop string
                self._finish(event, last)
            return self.finished
        if self.finished is not None:
            return None  # sampled past the stop: dropped
        token = self._token(event)
        if not self.stops.stopped:
            return token
        self.end_at(self.n_tokens)
        self._finish(Finished("stop", self.req.prompt_tokens, self.n_tokens, self.req.cached_tokens), token)
        return None

    def _token(self, event: TokenEvent) -> TokenEvent:
        self.n_tokens += 1
        delta = "" if event.ends_text else self.stops.feed(self.detok.push(event.token))
        self.text += delta
        return dataclasses.replace(event, text=delta)

    def _finish(self, end: Finished, last: TokenEvent | None) -> None:
        tail = "" if self.stops.stopped else self.stops.feed(self.detok.flush()) + self.stops.flush()
        self.text += tail
        self.finished = dataclasses.replace(end, last=last, text=tail, output=self.text)
