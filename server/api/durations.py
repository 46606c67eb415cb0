"""Go durations ("5m", "1h30m", "1.5s", "0"), as Ollama's keep_alive takes them, read by a scanner that looks
at each character once: a regex with a repeated group over digits backtracks quadratically on a long run
of digits with no unit, and a request must not hold the event loop for that."""
from __future__ import annotations

MAX_DURATION_CHARS = 64  # Go's longest duration, "-2562047h47m16.854775808s", is 25 characters
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TWO_CHAR_UNITS = frozenset(u for u in _SECONDS if len(u) == 2)


def duration_seconds(text: str) -> float | None:
    """The length of a Go duration in seconds, its sign ignored (what `keep_alive` 0 tests), or None where
    `text` (surrounding whitespace aside) is not one: a sign, then "0" or numbers each with its unit."""
    text = text.strip()
    if len(text) > MAX_DURATION_CHARS:
        return None
    at = 1 if text[:1] in ("-", "+") else 0
    if text[at:] == "0":
        return 0.0
    total, parts = 0.0, 0
    while at < len(text):
        start = at
        while at < len(text) and text[at].isdecimal():
            at += 1
        whole = at > start
        if at < len(text) and text[at] == ".":
            at += 1
            fraction = at
            while at < len(text) and text[at].isdecimal():
                at += 1
            if not whole and at == fraction:
                return None  # "." alone is no number
        elif not whole:
            return None
        number = text[start:at]
        unit = text[at:at + 2] if text[at:at + 2] in _TWO_CHAR_UNITS else text[at:at + 1]
        if unit not in _SECONDS:
            return None
        at += len(unit)
        total += float(number) * _SECONDS[unit]
        parts += 1
    return total if parts else None
