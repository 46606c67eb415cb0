"""A streamed response's events, in the Responses API's shapes: each output item is announced
(`response.output_item.added`), streamed (text deltas, or a function call's argument deltas) and closed
(`response.output_item.done`). The reply's text is read as every dialect reads it (reply.py): a think
block comes out as a reasoning item (its text as `response.reasoning_text.delta` events), tool calls as
function_call items, and neither's markup reaches the message's text.

The items are built as they stream: the final response's output is exactly what was streamed, as the
SDK's stream helper checks, less any call that max_output_tokens cut short (closed as incomplete).
"""
from __future__ import annotations

import json
import secrets

from .reply import ReplyReader


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(24)


def message_item(text: str, status: str, item_id: str | None = None, logprobs: list[dict] | None = None) -> dict:
    """A reply's text as a message item; `logprobs` (include's message.output_text.logprobs) those of its tokens."""
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": item_id or new_id("msg_"), "type": "message", "status": status, "role": "assistant",
            "content": [part]}


def reasoning_item(text: str, status: str, item_id: str | None = None, summarised: bool = False) -> dict:
    """A reply's think block: its text as reasoning_text content, and as the summary too where one was asked
    for (kvserve does not summarise: the summary is the reasoning, whole)."""
    summary = [{"type": "summary_text", "text": text}] if summarised and text else []
    return {"id": item_id or new_id("rs_"), "type": "reasoning", "status": status, "summary": summary,
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("fc_"), "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


class ResponseEvents:
    """Feeds on the reply's text; gives the SSE events to send, and keeps the output items they describe."""

    def __init__(self, reader: ReplyReader, scored: bool = False, summarised: bool = False) -> None:
        self.reply = None if reader.plain else reader.stream()
        self.summarised = summarised
        # the text's logprobs, where its tokens are all text: with tools offered (or a think block), a message
        # is the reply less the markup, whose tokens cannot be told apart from its own, so it carries none
        self.scored = scored and self.reply is None
        self.logprobs: list[dict] = []  # the open message's, so far
        self.unsent: list[dict] = []  # those of tokens whose text has not been sent yet (held back)
        self.sequence = 0
        self.items: list[dict] = []  # every item announced, in order; the last is open until closed
        self.open = False
        self.text = ""  # the open message's (or reasoning's) text so far
        self.arguments = ""  # the open call's arguments so far

    @property
    def reasoning_tokens(self) -> int:
        return self.reply.reasoning_tokens if self.reply is not None else 0

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def feed(self, text: str, logprobs: list[dict] = ()) -> list[str]:
        """The events for the reply's next text; `logprobs`: those of the tokens it came from, when scored."""
        if self.reply is None:
            self.unsent += logprobs if self.scored else []
            return self._text(text)
        reasoning, content, deltas = self.reply.feed(text)
        # within one feed, reasoning comes first, and text can only follow calls (ToolCallStream's content mode is final)
        return self._reasoning(reasoning) + self._calls(deltas) + self._text(content)

    def finish(self, status: str) -> list[str]:
        """The events that end the stream's items; `status` is the response's ("completed" or "incomplete")."""
        out: list[str] = []
        if self.reply is not None:
            reasoning, content, deltas = self.reply.finish()
            out += self._reasoning(reasoning) + self._text(content) + self._calls(deltas)
        if self.open:
            last = self.items[-1]
            if last["type"] == "function_call":
                cut = self._call_index() >= self.reply.complete  # the call max_output_tokens ended inside
                out += self._close("incomplete" if cut else "completed")
            else:
                out += self._close(status)
        return out

    def output(self) -> list[dict]:
        """The items the response keeps: every message, and the function calls that were complete (a stream
        left mid-text keeps the text so far)."""
        closed = self.items[: len(self.items) - self.open]
        kept = [i for i in closed if i["type"] != "function_call" or i["status"] == "completed"]
        if self.open and self.items[-1]["type"] == "message":
            kept.append(message_item(self.text, "incomplete", self.items[-1]["id"], self._scores()))
        if self.open and self.items[-1]["type"] == "reasoning":
            kept.append(reasoning_item(self.text, "incomplete", self.items[-1]["id"], self.summarised))
        return kept

    def _scores(self) -> list[dict] | None:
        return self.logprobs + self.unsent if self.scored else None

    def _call_index(self) -> int:
        return sum(i["type"] == "function_call" for i in self.items) - 1

    def _text(self, text: str) -> list[str]:
        if not text:
            return []
        out: list[str] = []
        if not self.open or self.items[-1]["type"] != "message":
            out += self._close("completed") if self.open else []
            item = message_item("", "in_progress")
            item["content"] = []
            out += self._announce(item)
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.text += text
        sent, self.unsent = self.unsent, []
        self.logprobs += sent
        out.append(self.event("response.output_text.delta", item_id=self.items[-1]["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=sent))
        return out

    def _reasoning(self, text: str) -> list[str]:
        if not text:
            return []
        out: list[str] = []
        if not self.open or self.items[-1]["type"] != "reasoning":
            out += self._close("completed") if self.open else []
            item = reasoning_item("", "in_progress")
            item["content"] = []
            out += self._announce(item)
        self.text += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                              output_index=len(self.items) - 1, content_index=0, delta=text))
        return out

    def _calls(self, deltas: list[dict]) -> list[str]:
        out: list[str] = []
        for delta in deltas:
            arguments = delta["function"].get("arguments", "")
            arguments = arguments if self.arguments else arguments.lstrip()  # the whitespace before the JSON
            if "id" in delta:  # a new call: the item before it (text, or a call) is complete
                out += self._close("completed") if self.open else []
                out += self._announce(call_item(delta["id"], delta["function"]["name"], "", "in_progress"))
            if arguments:
                self.arguments += arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=self.items[-1]["id"],
                                      output_index=len(self.items) - 1, delta=arguments))
        return out

    def _announce(self, item: dict) -> list[str]:
        self.items.append(item)
        self.open, self.text, self.arguments, self.logprobs = True, "", "", []
        return [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]

    def _close(self, status: str) -> list[str]:
        index, item = len(self.items) - 1, self.items[-1]
        out: list[str] = []
        if item["type"] == "message":
            done = message_item(self.text, status, item["id"], self._scores())
            part = done["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=self.text, logprobs=part.get("logprobs", [])))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part))
        elif item["type"] == "reasoning":
            done = reasoning_item(self.text, status, item["id"], self.summarised)
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=self.text))
        else:
            done = call_item(item["call_id"], item["name"], self.arguments, status, item["id"])
            if status == "completed":
                out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                      name=item["name"], arguments=self.arguments))
        self.items[-1], self.open = done, False
        out.append(self.event("response.output_item.done", output_index=index, item=done))
        return out
