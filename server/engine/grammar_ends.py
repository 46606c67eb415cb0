"""Whether a Lark grammar can ever end: a rule is productive when some alternative of it is made only of
text and productive rules. A `start` that is not productive can only recur (`start: ("a" | "b") start`),
so no output completes it, and the request is refused before it runs rather than cut at max_tokens.

llguidance compiles such grammars without complaint, and a bounded search cannot prove a negative, so
this reads the grammar itself: the subset of Lark that rules are written in. A grammar using anything
else gets no verdict (None), and llguidance's own checks stand.
"""
from __future__ import annotations

import re

_TOKEN = re.compile(r'''
    (?P<ws>\s+|//[^\n]*|\#[^\n]*)
  | (?P<text>"(?:\\.|[^"\\])*"i?|/(?:\\.|[^/\\\n])+/[imslux]*|<\[[0-9,\-\s]*\]>|<[^<>\s]+>)
  | (?P<directive>%[a-z_]+)
  | (?P<head>[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]\n]*\])?(?:\.-?[0-9]+)?\s*:(?!:))
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<range>\.\.)
  | (?P<op>->|[|()\[\]?*+~{},&!]|[0-9]+)
''', re.X)


def _tokens(text: str) -> list[tuple[str, str]] | None:
    out, at = [], 0
    while at < len(text):
        m = _TOKEN.match(text, at)
        if m is None:
            return None
        at = m.end()
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
    return out


def _rules(tokens: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]] | None:
    """Each rule's body tokens; None where a directive other than an ignore or an empty %llguidance shows."""
    rules: dict[str, list] = {}
    current: list | None = None
    i = 0
    while i < len(tokens):
        kind, value = tokens[i]
        if kind == "head":
            name = re.match(r"[A-Za-z_][A-Za-z0-9_]*", value).group()
            current = rules.setdefault(name, [])
            if current:
                current.append(("op", "|"))
        elif kind == "directive":
            if value == "%llguidance" and tokens[i + 1:i + 3] == [("op", "{"), ("op", "}")]:
                i += 3
                current = None
                continue
            return None  # %ignore, %import, %json and the like: not read here
        elif current is None:
            return None
        else:
            current.append((kind, value))
        i += 1
    return rules


def _productive(body: list[tuple[str, str]], known: set[str]) -> bool | None:
    """Whether the body (alternatives) can produce a finite text, given the rules `known` to."""
    pos = 0

    def alternatives() -> bool:
        nonlocal pos
        ok = sequence()
        while pos < len(body) and body[pos] == ("op", "|"):
            pos += 1
            ok = sequence() or ok
        return ok

    def sequence() -> bool:
        nonlocal pos
        ok = True
        while pos < len(body) and body[pos] not in (("op", "|"), ("op", ")"), ("op", "]")):
            ok = item() and ok
        return ok

    def item() -> bool:
        nonlocal pos
        kind, value = body[pos]
        pos += 1
        if kind == "text":
            ok = True
            if pos < len(body) and body[pos][0] == "range":
                pos += 2  # "a".."z"
        elif kind == "name":
            ok = value in known
        elif (kind, value) in (("op", "("), ("op", "[")):
            ok = alternatives() or value == "["
            if pos >= len(body) or body[pos][1] != (")" if value == "(" else "]"):
                raise ValueError("unbalanced")
            pos += 1
        else:
            raise ValueError(f"unexpected {value}")
        while pos < len(body) and body[pos][0] == "op" and body[pos][1] in "?*+~{":
            op = body[pos][1]
            pos += 1
            if op in "?*":
                ok = True
            elif op in "~{":  # x~n, x~n..m, x{n}, x{n,m}: empty only if n is 0
                low = body[pos][1]
                while pos < len(body) and (body[pos][0] == "range" or body[pos][1] in ",}" or body[pos][1].isdigit()):
                    pos += 1
                    if body[pos - 1][1] == "}":
                        break
                ok = ok or low == "0"
        if pos < len(body) and body[pos] == ("op", "->"):
            pos += 2  # an alias names the tree node only
        return ok

    try:
        result = alternatives()
    except (ValueError, IndexError):
        return None
    return result if pos == len(body) else None


def can_end(lark: str, start: str = "start") -> bool | None:
    """False if the grammar's start rule can never finish; None if this reader cannot tell."""
    tokens = _tokens(lark)
    rules = _rules(tokens) if tokens is not None else None
    if not rules or start not in rules:
        return None
    # a rule is looked at again only when one it names becomes productive: linear in the grammar's size,
    # where sweeping every rule until none changes is quadratic in a chain of rules
    users: dict[str, set[str]] = {}
    for name, body in rules.items():
        for kind, value in body:
            if kind == "name":
                users.setdefault(value, set()).add(name)
    known: set[str] = set()
    pending = list(rules)
    while pending:
        name = pending.pop()
        if name in known:
            continue
        verdict = _productive(rules[name], known)
        if verdict is None:
            return None
        if verdict:
            known.add(name)
            pending.extend(users.get(name, ()))
    used = {t for body in rules.values() for (k, t), before in zip(body, [None, *body]) if k == "name" and before != ("op", "->")}
    if used - rules.keys():
        return None  # a rule defined elsewhere (an import): no verdict
    return start in known
