"""Values a JSON body can hold that no route can use, refused up front with a 400 that says where.

- A lone surrogate: the escape "\\ud800" decodes to a str that is no Unicode text, which the tokenizer, a
  chat template's output and every UTF-8 writer refuse with a TypeError or a UnicodeEncodeError deep
  inside a route. pydantic refuses it in its constrained strings, not in free-form values (`Any`, a tool's
  `parameters`, dict keys).
- A number beyond a double's range: Python reads 1e400 as inf (and takes NaN and Infinity, which JSON has
  not), and no JSON reply can echo it back (a reply that names its tools would fail as it is written).
  Integers are exact in Python and JSON at any size: each typed field bounds its own.
"""
from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from ..errors import InvalidRequest, cut

_SURROGATE = "holds a lone surrogate (an unpaired \\ud800-\\udfff escape)"


def _text_ok(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unusable_value_at(value: Any) -> tuple[str, str] | None:
    """(where, what) for the first unusable value in `value` (a decoded JSON body), the place as a dotted path
    ("" for the body itself); None where there is none. The common answer, none, comes from the C encoder;
    only a body it fails on is walked in Python."""
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError, ValueError, TypeError, OverflowError):
        return _walk(value)
    return None


def _walk(value: Any) -> tuple[str, str] | None:
    """Iterative, each step's path a link to its parent's: a body's nesting depth is the client's to choose."""
    stack: list[tuple[Any, tuple | None]] = [(value, None)]
    while stack:
        node, link = stack.pop()
        if isinstance(node, str):
            if not _text_ok(node):
                return _path(link), "a string " + _SURROGATE
        elif isinstance(node, float):
            if not math.isfinite(node):
                return _path(link), "a number is out of a double's range (or NaN)"
        elif isinstance(node, dict):
            for key, item in node.items():
                if isinstance(key, str) and not _text_ok(key):
                    return _path(link), "a key " + _SURROGATE
                if isinstance(item, (str, float, dict, list)):
                    stack.append((item, (link, key)))
        elif isinstance(node, list):
            stack.extend((item, (link, i)) for i, item in enumerate(node) if isinstance(item, (str, float, dict, list)))
    return None


def _path(link: tuple | None) -> str:
    keys = []
    while link is not None:
        link, key = link
        keys.append(cut(str(key)))
    return ".".join(reversed(keys))


async def refuse_unusable_values(request: Request) -> None:
    """Every route's dependency: it runs after FastAPI has parsed the body (kept on the request) and before
    the body's own validation, so the answer is the same whatever field holds the value."""
    if request.method not in ("POST", "PUT", "PATCH") or not await request.body():
        return
    try:
        value = await request.json()
    except (ValueError, RecursionError):
        return  # no JSON: the route answers that itself
    found = unusable_value_at(value)
    if found is not None:
        where, what = found
        raise InvalidRequest(f"{where or 'body'}: {what}", param=where or None)
