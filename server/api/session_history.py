"""A session's history as a client can show and continue it: its text, and, where that text is a chat in the
model's template, the messages that render to it.

A session keeps tokens, not messages. The messages are read back from the text by the template's own
wrapping: a probe chat of placeholder turns shows what the template writes before each role's content
(its head) and after it (its tail). A reading counts only if the messages render back to the very text,
so a client that resends them (with a new turn after) keeps the session's whole history instead of
overwriting it. Any history the template did not write (TGI's /generate, a template that rewrites past
turns) has text only.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

from models.tokenizer import ChatTemplateError, TextTokenizer

# placeholders no template trims or escapes, and no conversation contains
PROBE = {"system": "kvsProbeSystem", "user": "kvsProbeUser", "assistant": "kvsProbeReply"}


@dataclass(frozen=True)
class Wrapping:
    """How the template writes a chat: `start`, then per message heads[role] + content + tail."""

    start: str
    heads: dict[str, str]
    tail: str


def history(tok: TextTokenizer, tokens: list[int]) -> dict:
    """`text`: the history as a completion prompt continues it (the BOS the tokenizer adds left out);
    `messages`: the chat it is, or None."""
    full = tok.decode(tokens, skip_special=False)
    text = full
    if tok.meta.add_bos and tok.bos_id is not None and tokens[:1] == [tok.bos_id]:
        text = tok.decode(tokens[1:], skip_special=False)
    wrapping = _wrapping(tok)
    return {"text": text, "messages": read_chat(tok, wrapping, full) if wrapping is not None else None}


def read_chat(tok: TextTokenizer, w: Wrapping, text: str) -> list[dict] | None:
    """The messages that render to `text`, or None. An unfinished reply at the end (cut by max_tokens or a
    stop) is a message as far as it goes; a generation prompt with no reply yet is left out."""
    if not text:
        return []
    if not text.startswith(w.start):
        return None
    end = w.tail.rstrip()  # the end-of-turn token; the whitespace after it may not be in the history yet
    heads = sorted(w.heads.items(), key=lambda kv: -len(kv[1]))
    messages, pos = [], len(w.start)
    while pos < len(text):
        role = next((r for r, head in heads if text.startswith(head, pos)), None)
        if role is None:
            return None
        pos += len(w.heads[role])
        cut = text.find(end, pos)
        if cut < 0:
            if role != "assistant":
                return None
            if pos < len(text):
                messages.append({"role": role, "content": text[pos:]})
            pos = len(text)
            break
        messages.append({"role": role, "content": text[pos:cut]})
        pos = cut + len(end)
        rest = w.tail[len(end):]
        if text.startswith(rest, pos):
            pos += len(rest)
    if not messages:
        return None
    try:
        again = tok.apply_chat_template(messages, messages[-1]["role"] != "assistant")
    except ChatTemplateError:
        return None
    # what may follow the text is only the end of its last turn, or a generation prompt
    return messages if again.startswith(text) else None


@functools.lru_cache(maxsize=8)
def _wrapping(tok: TextTokenizer) -> Wrapping | None:
    """The template's heads and tail, from a rendered probe chat: system, user, assistant, user, assistant."""
    turns = [("system", "0"), ("user", "1"), ("assistant", "2"), ("user", "3"), ("assistant", "4")]
    try:
        text = tok.apply_chat_template([{"role": r, "content": PROBE[r] + n} for r, n in turns], False)
    except ChatTemplateError:
        return None
    pieces, pos = [], 0
    for role, n in turns:
        at = text.find(PROBE[role] + n, pos)
        if at < 0:
            return None
        pieces.append(text[pos:at])
        pos = at + len(PROBE[role] + n)
    pieces.append(text[pos:])
    between = pieces[1:]  # tail + the next head, and last the tail alone
    tail = os.path.commonprefix(between)
    if not tail.strip():
        return None
    heads = {"user": between[0][len(tail):], "assistant": between[1][len(tail):]}
    if between[2][len(tail):] != heads["user"] or between[3][len(tail):] != heads["assistant"]:
        return None
    # the system head is the user head with the role's name changed; what precedes it starts every chat
    system = heads["user"].replace("user", "system")
    if "user" not in heads["user"] or not pieces[0].endswith(system):
        return None
    return Wrapping(pieces[0][: len(pieces[0]) - len(system)], {**heads, "system": system}, tail)
