"""What a client's constraint may be, checked before anything compiles it: the size of a grammar, a regex or a
schema, its rules, how deep it nests, and how many tools a request offers. Each refusal names its limit.

The grammar library recurses on nesting and on chains of rules (deep enough, its stack overflows and the
process dies), and our own readers (grammar_ends.py, the schema walks in constraints.py and anthropic's
checks) recurse too, so depth is bounded here with loops that cannot overflow. The bounds sit far above
what real grammars and schemas use: OpenAI's own API allows 128 tools, and pydantic's deepest models nest
a few levels. Time is bounded apart, by the compile budget (grammar_worker.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidRequest


@dataclass(frozen=True)
class ConstraintLimits:
    text_bytes: int = 1024 * 1024  # a grammar, a regex, a schema or a choice list, as sent
    rules: int = 1000  # rules of one grammar
    depth: int = 64  # nesting: groups of a grammar or regex, objects and arrays of a schema
    tools: int = 128  # tools one request may offer


LIMITS = ConstraintLimits()

# a rule's head at the start of a line: `name:` (Lark, with its `name.2:` priority) or `name ::=` (GBNF)
_RULE_HEAD = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_-]*(?:\.-?[0-9]+)?[ \t]*(?::|::=)", re.M)


def _refuse(param: str, what: str) -> None:
    raise InvalidRequest(f"invalid {param}: {what}", param=param)


def check_size(text: str, param: str, limits: ConstraintLimits = LIMITS) -> None:
    if len(text.encode("utf-8", "surrogatepass")) > limits.text_bytes:
        _refuse(param, f"it is larger than the limit of {limits.text_bytes} bytes")


def check_grammar(text: str, param: str, limits: ConstraintLimits = LIMITS) -> None:
    """A Lark or GBNF grammar: its size, its rule count, and how deep its groups nest."""
    check_size(text, param, limits)
    rules = sum(1 for _ in _RULE_HEAD.finditer(text))
    if rules > limits.rules:
        _refuse(param, f"it has {rules} rules; the limit is {limits.rules}")
    depth = _group_depth(text, opening="([", closing=")]", quotes='"')
    if depth > limits.depth:
        _refuse(param, f"its groups nest {depth} deep; the limit is {limits.depth}")


def check_regex(pattern: str, param: str, limits: ConstraintLimits = LIMITS) -> None:
    check_size(pattern, param, limits)
    depth = _group_depth(pattern, opening="(", closing=")", quotes="", classes=True)
    if depth > limits.depth:
        _refuse(param, f"its groups nest {depth} deep; the limit is {limits.depth}")


def check_schema(schema: Any, param: str, limits: ConstraintLimits = LIMITS) -> None:
    """A JSON schema (already parsed): how deep its objects and arrays nest, and its size as JSON."""
    depth = json_depth(schema, limits.depth)
    if depth > limits.depth:
        _refuse(param, f"it nests more than {limits.depth} levels deep; the limit is {limits.depth}")
    try:
        check_size(json.dumps(schema), param, limits)
    except (TypeError, ValueError) as e:  # a value JSON cannot hold (NaN is allowed; a set is not)
        _refuse(param, f"it is not JSON: {e}")


def check_tools(count: int, param: str, limits: ConstraintLimits = LIMITS) -> None:
    if count > limits.tools:
        _refuse(param, f"{count} tools were offered; the limit is {limits.tools}")


def json_depth(value: Any, stop: int) -> int:
    """How deep dicts and lists nest in `value`, counted without recursion, up to `stop` + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > stop:
            return deepest
        stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _group_depth(text: str, opening: str, closing: str, quotes: str, classes: bool = False) -> int:
    """The deepest nesting of groups in `text`, outside quoted strings (and, for a regex, outside character
    classes and after escapes): one pass, so any length costs linear time."""
    deepest = depth = 0
    quote: str | None = None
    in_class = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif quote is not None:
            quote = None if ch == quote else quote
        elif in_class:
            in_class = ch != "]"
        elif ch in quotes:
            quote = ch
        elif classes and ch == "[":
            in_class = True
        elif ch in opening:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in closing:
            depth = max(0, depth - 1)
    return deepest
