"""Tool-call formats, one module each, and the table that picks a model's format from its chat template.

Only a template that renders `tools` itself tells its model a format of its own: one that does not gets
the tools described in the Hermes format (tools.py), so its replies are read in that format too.
"""
from __future__ import annotations

from . import harmony, hermes, llama3_json, mistral, pythonic, qwen3_coder
from .base import ToolFormat

# (text one of which the template holds, the format its model writes): the first that matches wins
TABLE: tuple[tuple[tuple[str, ...], ToolFormat], ...] = (
    (("[CALL_ID]",), mistral.WITH_IDS),
    (("[ARGS]",), mistral.NAMED),
    (("[TOOL_CALLS]",), mistral.FORMAT),
    # Qwen3-Coder's and Qwen3.5's XML calls: before Hermes', whose marker their templates hold too
    (("<tool_call>\\n<function=", "<tool_call>\n<function="), qwen3_coder.FORMAT),
    (("<tool_call>",), hermes.FORMAT),
    (("<|python_tag|>", "<|start_header_id|>"), llama3_json.FORMAT),  # Llama 3.1's and 3.2's templates
    # LFM2's: those that write calls name the marker; the others list tools in their markers, or bare
    (("<|tool_call_start|>", "<|tool_list_start|>", "List of tools: ["), pythonic.FORMAT),
)


def format_for(template: str | None) -> ToolFormat:
    """The format of the replies of a model with this chat template (Hermes unless the table says otherwise).
    gpt-oss's channels are its replies' format with tools or without: they carry its reasoning too."""
    if template and harmony.CHANNEL in template:
        return harmony.FORMAT
    if not template or "tools" not in template:
        return hermes.FORMAT
    return next((fmt for markers, fmt in TABLE if any(m in template for m in markers)), hermes.FORMAT)
