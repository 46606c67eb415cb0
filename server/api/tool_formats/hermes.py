"""The Hermes format (Qwen2.5, Qwen3, Hermes and what kvserve describes to a template without tools):
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks, parsed by tools.py and tool_stream.py. It is
also the format of the calls kvserve describes to a template that has no tools of its own."""
from __future__ import annotations

from .. import tools
from ..tool_stream import ToolCallStream
from ..chat_messages import structured_message
from .base import ToolFormat

FORMAT = ToolFormat(
    name="hermes",
    parse=lambda text, names: tools.parse_tool_calls(text, names),
    stream=lambda names: ToolCallStream(names, False),
    history=structured_message,
    call_end=tools.CLOSE_TAG,
)
FORCED = ToolFormat(  # a reply a forced tool_choice's grammar wrote: calls only
    name="hermes-forced",
    parse=lambda text, names: tools.parse_tool_calls(text, names, True),
    stream=lambda names: ToolCallStream(names, True),
    history=structured_message,
    call_end=tools.CLOSE_TAG,
)
