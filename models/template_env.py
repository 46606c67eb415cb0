"""The Jinja environment chat templates run in, built as transformers builds it (its
utils/chat_template_utils.py), so that a template renders here what it renders there.

A sandbox with trimmed blocks; loop controls (`{% break %}`, which Apertus's, Kimi's and others' use); the
`{% generation %}` block, a training-time marker whose body renders as it is; `tojson` with
transformers' options and without HTML escaping; `raise_exception`, `strftime_now`, a `dict` constructor,
and a `namespace` that refuses names starting with an underscore. Messages reach the template as
transformers passes them (template_messages).
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# the names an earlier reply's reasoning comes under; templates read the first, gpt-oss's `thinking`
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}`: marks what the assistant wrote, for training masks."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class TemplateDict:
    """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    """Jinja's namespace, refusing the underscore names through which a template could reach Python's."""

    def __init__(*args, **kwargs):  # Namespace's signature: a key named `self` still works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template may not set {name!r} on a namespace")


def raise_exception(message: str):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as transformers hands them to a template: keys whose value is None dropped (templates test
    for a key, and would write "None"), and an earlier reply's reasoning under each name templates read."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out
