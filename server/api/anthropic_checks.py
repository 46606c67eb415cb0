"""What Anthropic's Messages API checks of a request beyond its fields' shapes, with its messages: how the
turns hold together around tool calls, and that each tool's input_schema is a JSON Schema of an object.

Consecutive messages of one role are one turn, as Anthropic merges them (and a first turn may be the
assistant's). A tool_result answers a tool_use of the assistant turn right before its own user turn, and a
user turn after an assistant turn that called tools answers every one of those calls: a result the
model never asked for, or a call whose result is missing, would be rendered as a conversation that
never happened.

The schemas are checked under every tool_choice, before any grammar is built from them: a bad schema
gets a 400 that names its tool even where no grammar would have read it (auto, none).
"""
from __future__ import annotations

from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from ..engine import constraint_limits
from ..errors import InvalidRequest, cut
from .anthropic_schemas import Message, Tool, ToolResultBlock, ToolUseBlock

MAX_REASON = 200  # characters of the validator's reason quoted back: it may repeat a large part of the schema
_METASCHEMA = Draft202012Validator(Draft202012Validator.META_SCHEMA)


def check_turns(messages: list[Message]) -> None:
    asked: dict[str, int] = {}  # the previous assistant turn's tool_use ids -> the message that holds each
    for role, blocks in _turns(messages):
        if role == "assistant":
            asked = {b.id: i for i, _, b in blocks if isinstance(b, ToolUseBlock)}
            continue
        answered = set()
        for i, j, b in blocks:
            if not isinstance(b, ToolResultBlock):
                continue
            if b.tool_use_id not in asked:
                raise InvalidRequest(
                    f"messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: "
                    f"{cut(b.tool_use_id)}. Each `tool_result` block must have a corresponding `tool_use` block in "
                    "the previous message.", param=f"messages.{i}.content.{j}")
            answered.add(b.tool_use_id)
        missing = [k for k in asked if k not in answered]
        if missing:
            raise InvalidRequest(
                f"messages.{asked[missing[0]]}: `tool_use` ids were found without `tool_result` blocks immediately "
                f"after: {', '.join(cut(k) for k in missing[:8])}. Each `tool_use` block must have a corresponding "
                "`tool_result` block in the next message.", param=f"messages.{asked[missing[0]]}")
        asked = {}


def _turns(messages: list[Message]) -> list[tuple[str, list[tuple[int, int, object]]]]:
    """Runs of messages of one role: (role, [(message index, block index, block)])."""
    turns: list[tuple[str, list]] = []
    for i, m in enumerate(messages):
        blocks = [] if isinstance(m.content, str) else [(i, j, b) for j, b in enumerate(m.content)]
        if turns and turns[-1][0] == m.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((m.role, blocks))
    return turns


def check_tools(tools: list[Tool]) -> None:
    constraint_limits.check_tools(len(tools), "tools")
    for i, t in enumerate(tools):
        schema = t.input_schema
        constraint_limits.check_schema(schema, f"tools.{i}.input_schema")  # the metaschema check recurses
        if schema.get("type") != "object":
            raise InvalidRequest(f"tools.{i}.input_schema.type: the input_schema of tool {t.name!r} must have type "
                                 f"'object' (a tool's input is a JSON object)", param=f"tools.{i}.input_schema.type")
        error = best_match(_METASCHEMA.iter_errors(schema))
        if error is not None:
            where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
            reason = error.message if len(error.message) <= MAX_REASON else error.message[:MAX_REASON - 3] + "..."
            raise InvalidRequest(f"tools.{i}.input_schema: the input_schema of tool {t.name!r} is not a valid JSON "
                                 f"Schema (draft 2020-12): at input_schema{where}: {reason}",
                                 param=f"tools.{i}.input_schema")
