"""Stop strings matched across token boundaries: text that may begin a stop string is held back."""
from __future__ import annotations


class StopMatcher:
    """Feeds on text deltas; releases only text that can no longer be part of a stop string. With
    `repeat_end`, each block of text released that ends in it becomes a stop string too: a block said
    again ends the text before it."""

    def __init__(self, stops: tuple[str, ...], repeat_end: str | None = None) -> None:
        self.stops = tuple(s for s in stops if s)
        self.repeat_end = repeat_end
        self._held = ""
        self._block = ""  # released text since the last block ended
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Return the text safe to emit now; sets `stopped` once a stop string appears."""
        out = self._match(delta)
        if self.repeat_end and not self.stopped:
            self._block += out
            while (end := self._block.find(self.repeat_end)) >= 0:
                cut = end + len(self.repeat_end)
                if self._block[:cut] not in self.stops:
                    self.stops += (self._block[:cut],)
                self._block = self._block[cut:]
        return out

    def _match(self, delta: str) -> str:
        if not self.stops:
            return delta
        text = self._held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, ""
            return text[: min(hits)]
        keep = 0
        for s in self.stops:
            # the longest tail of text that is a proper prefix of s could still become s
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    keep = max(keep, n)
                    break
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """At the end of generation, held text was no stop string after all."""
        held, self._held = self._held, ""
        return held
