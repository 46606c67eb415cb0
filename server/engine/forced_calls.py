"""The grammar of a forced reply (tool_choice "required" or a named function, Anthropic's "any" or "tool"):
calls of the offered functions and nothing else, laid out in the model's own call format, so that what the
grammar has the model write is what it was trained to write and what its template writes back next turn.

Each format (server/api/tool_formats/) gives a layout: a function of the offered functions, as the pieces
below, and whether several calls may follow one another, to a Lark grammar. A layout asks `marker` for its
fixed markers: one that is a control token of the model's vocabulary ([TOOL_CALLS], harmony's <|channel|>)
is matched as that token, as the model writes it (as text it would never match); one that ends generation
ends the grammar, where the engine's end of sequence follows; any other is text. Arguments are JSON written
as compactly as the template writes it (JSON_LAYOUT): no free whitespace for a small model to pad with.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.tokenizer import TextTokenizer

# Fixed separators and no free whitespace in generated JSON (every constraint's): a small model otherwise
# pads it with newlines and indentation until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class OfferedCalls:
    """The functions a forced reply may call, and the model's markers, for a layout to write its rules with."""

    names: tuple[str, ...]
    parameters: tuple[Any, ...]  # each function's JSON schema of its arguments
    marker: Callable[[str], str]  # a fixed marker as a Lark term (see the module's note)

    def arguments(self, i: int) -> str:
        """`%json{...}`: function i's arguments alone."""
        defs: dict = {}
        root = _embedded(self.parameters[i], defs, "", "#")
        return _json_term(root, defs)

    def argument(self, i: int, name: str) -> str:
        """`%json{...}`: function i's argument `name` alone (its definitions beside it)."""
        defs: dict = {}
        root = _embedded(self.parameters[i], defs, "", "#")
        return _json_term(root["properties"][name], defs)

    def call_object(self, i: int, key: str = "arguments", extra: dict | None = None) -> str:
        """`%json{...}`: {"name": function i's name, key: its arguments, then `extra`'s properties}."""
        defs: dict = {}
        properties = {"name": {"const": self.names[i]},
                      key: _embedded(self.parameters[i], defs, "", f"#/properties/{key}"), **(extra or {})}
        return _json_term({"type": "object", "properties": properties, "required": list(properties),
                           "additionalProperties": False}, defs)

    def properties(self, i: int) -> tuple[dict, set[str]]:
        """Function i's arguments by name, each one's schema, and the names of those required."""
        schema = self.parameters[i] if isinstance(self.parameters[i], dict) else {}
        return dict(schema.get("properties") or {}), set(schema.get("required") or ())

    def each(self, rule: Callable[[int], str]) -> str:
        """A group of one alternative a function."""
        return "(" + " | ".join(rule(i) for i in range(len(self.names))) + ")"


Layout = Callable[[OfferedCalls, bool], str]  # (the offered calls, whether several may follow) -> Lark


def marker_term(tokenizer: TextTokenizer) -> Callable[[str], str]:
    specials = {t.content: i for i, t in tokenizer.tokenizer.get_added_tokens_decoder().items() if t.special}

    def term(text: str) -> str:
        token = specials.get(text)
        if token is None:
            return json.dumps(text)
        return "" if token in tokenizer.eos_ids else f"<[{token}]>"
    return term


def text(value: str) -> str:
    return json.dumps(value)


def hermes(calls: OfferedCalls, parallel: bool) -> str:
    """`<tool_call>` blocks, a newline between two, as Hermes templates write them: after a call's close the
    model weighs its end against another call where it was trained to."""
    more = ' ("\\n" call)*' if parallel else ""
    return f'start: call{more}\ncall: "<tool_call>\\n" {calls.each(calls.call_object)} "\\n</tool_call>"'


def _json_term(schema: dict, defs: dict) -> str:
    return "%json " + json.dumps({**schema, **({"$defs": defs} if defs else {}), "x-guidance": JSON_LAYOUT})


def _embedded(schema: Any, defs: dict, prefix: str, at: str) -> Any:
    """A tool's parameter schema as it reads inside a larger schema, where its root is `at`: its
    definitions ($defs, or the older definitions, as pydantic writes for nested models) move to the root's
    $defs under `prefix`, and every local $ref is rewritten to point where its target now is."""
    def ref(target: str) -> str:
        for section in ("#/$defs/", "#/definitions/"):
            if target.startswith(section):
                return "#/$defs/" + prefix + target[len(section):]
        return at + target[1:] if target.startswith("#") else target

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        return {k: ref(v) if k == "$ref" and isinstance(v, str) else walk(v) for k, v in node.items()}

    if not isinstance(schema, dict):
        return schema
    for section in ("$defs", "definitions"):
        for name, definition in (schema.get(section) or {}).items():
            defs[prefix + name] = walk(definition)
    return walk({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
