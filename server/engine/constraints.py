"""Constrained decoding: what a request's output must match (JSON schema, regex, Lark/GBNF grammar, tool
calls), compiled by llguidance into a matcher that gives the tokens allowed next.

llguidance rather than xgrammar or outlines-core: it installs here as one Rust wheel with no
dependencies, reads `tokenizer.json` directly, compiles a schema fast enough to do it in the request's
handler (never on the model thread), and computes a row's mask in a small fraction of a step, so
masks for a step are computed while its forward runs.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from models.tokenizer import TextTokenizer

from ..errors import InvalidRequest
from .closing import OPEN, WINDOW, Ending, Vocabulary, nest
from .grammar_ends import can_end


# Fixed separators and no free whitespace in generated JSON: a small model otherwise pads it with
# newlines and indentation until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
RECHECK = 16  # tokens between looks for the shortest ending while the end is still far
# llguidance's parser refuses a row of more than 2,000 Earley items by default, and a choice among more
# alternatives than that (an enum of names as a grammar) is one such row once its first byte is read: the
# reply failed there. A wider row is allowed, while step_max_items still bounds what any one mask may cost.
# Errors stay short: a verbose one quotes the whole grammar back to the client.
LIMITS = llguidance.LLParserLimits(max_items_in_row=20_000, verbose_errors=False)


class Grammars:
    """Compiles output constraints for one tokenizer (its llguidance view is built on first use)."""

    def __init__(self, tokenizer: TextTokenizer, max_context: int) -> None:
        self._tokenizer, self.max_context = tokenizer, max_context
        self._ll: llguidance.LLTokenizer | None = None
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                tok = self._tokenizer
                self._ll = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size,
                                                  eos_token=sorted(tok.eos_ids) or None)
            return self._ll

    @property
    def vocabulary(self) -> Vocabulary:
        with self._lock:
            if self._vocab is None:
                tok = self._tokenizer
                texts = tok.tokenizer.decode_batch([[i] for i in range(tok.vocab_size)], skip_special_tokens=False)
                self._vocab = Vocabulary.of(texts, frozenset(tok.eos_ids))
            return self._vocab

    # ---- grammars, from what clients send ------------------------------------------------------
    @staticmethod
    def json_schema(schema: Any, param: str) -> str:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"the JSON schema is not JSON: {e}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("a JSON schema must be an object", param=param)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)

    @staticmethod
    def regex(pattern: str) -> str:
        return llguidance.LLMatcher.grammar_from_regex(pattern)

    @staticmethod
    def lark(text: str, param: str) -> str:
        """A Lark grammar, or GBNF (llama.cpp's format), which llguidance converts."""
        try:
            lark = any_to_lark(text)
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except Exception as e:  # the GBNF converter raises plain exceptions on bad input
            raise InvalidRequest(f"the grammar does not parse: {e}", param=param) from None
        if can_end(lark) is False:
            raise InvalidRequest(f"invalid {param}: no output can complete it: every alternative of its start rule "
                                 "recurses, so it can never end", param=param)
        return grammar

    @staticmethod
    def choice(options: list[str]) -> str:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))

    @staticmethod
    def tool_calls(tools: list[dict], parallel: bool) -> str:
        """One or more (or exactly one) `<tool_call>` blocks, each a JSON call of one of `tools`."""
        defs: dict[str, Any] = {}
        calls = []
        for i, t in enumerate(tools):
            at = "#/properties/arguments" if len(tools) == 1 else f"#/anyOf/{i}/properties/arguments"
            arguments = _embedded(t["parameters"], defs, f"tool{i}_", at)
            calls.append({"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": arguments},
                          "required": ["name", "arguments"], "additionalProperties": False})
        root = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = json.dumps({**root, **({"$defs": defs} if defs else {}), "x-guidance": JSON_LAYOUT})
        lark = f'start: call{"+" if parallel else ""}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>\\n"'
        return llguidance.LLMatcher.grammar_from_lark(lark)

    # ---- matchers ------------------------------------------------------------------------------
    def check(self, grammar: str, param: str) -> str:
        """Raise a 400 naming the problem if `grammar` does not compile, or if no output can ever satisfy it:
        its language is empty, or it forces more tokens than the context holds. Returns it."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer, limits=LIMITS)
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(f"invalid {param}: {error.strip()}", param=param)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=LIMITS)
        matcher.compute_logit_bias()  # an empty language shows once the first mask is asked for
        if matcher.is_error() and _reason(matcher) == "NoExtensionBias":  # no token at all may come first
            raise InvalidRequest(f"invalid {param}: no output can match it (its language is empty)", param=param)
        if not matcher.is_error() and _forces_past(matcher, self.max_context):
            raise InvalidRequest(f"invalid {param}: no output can complete it: it forces more than the context of "
                                 f"{self.max_context} tokens before it could end (a rule that must always recur?)",
                                 param=param)
        if matcher.is_error():  # one of the parser's limits, met where a reply would meet it too
            raise InvalidRequest(f"invalid {param}: the grammar engine cannot follow it: {_reason(matcher)}",
                                 param=param)
        return grammar

    def matcher(self, grammar: str | None) -> Constraint | None:
        """A request's grammar state (None for no grammar). Compiled in the handler's thread, before it
        takes the engine's lock, which the model thread would otherwise wait on."""
        if grammar is None:
            return None
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=LIMITS)
        return Constraint(matcher, Ending(self.vocabulary, self._tokenizer.vocab_size))


def _embedded(schema: Any, defs: dict, prefix: str, at: str) -> Any:
    """A tool's parameter schema as it reads inside the schema of all calls, where its root is `at`: its
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


def _forces_past(matcher: llguidance.LLMatcher, limit: int) -> bool:
    """Whether the grammar forces more than `limit` tokens from its start, with no choice that could end it
    (say `start: "a" start`). llguidance gives a forced run in bounded pieces: take them until one ends it
    or the limit is passed. A piece the parser cannot follow (one of its limits, never the grammar's end)
    stops the count with no such claim; the matcher is then in error, for the caller to report."""
    forced = 0
    while not matcher.is_accepting():
        tokens = matcher.compute_ff_tokens()
        if not tokens:
            return False  # a choice comes next: whether it can end is not known here
        forced += len(tokens)
        if forced > limit:
            return True
        if not matcher.consume_tokens(tokens):
            return False
    return False


def _reason(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error, without the marker llguidance puts where the verbose part would be."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


class Constraint:
    """One request's grammar state: the tokens it allows next, advanced by each sampled token, and the
    shortest ending from here, so that a reply near its last tokens closes in time (closing.py)."""

    def __init__(self, matcher: llguidance.LLMatcher, ending: Ending) -> None:
        self.matcher, self.ending = matcher, ending
        self.nesting = OPEN
        self.ending_tokens: list[int] | None = None  # the shortest ending found from here (None: none in reach)
        self._looked_at: int | None = None  # the tokens left when it was looked for; None: look again
        self._next: tuple[int, list[int]] | None = None  # the token settle() let through, and the ending after it
        # the longest ending seen in this reply: what one token that opens a new structure (another tool
        # call, a nested object) may cost, so sampled tokens are checked from that far before the end
        self._reach = 0
        self._left = 0  # the tokens left at the last mask
        self.failed = False  # the grammar allowed no token at all: the reply cannot meet it
        self.dead_after: int | None = None  # this step's first draft row whose grammar allowed nothing

    def allowed(self, left: int) -> np.ndarray:
        """bool [vocab]: the tokens that keep the output within the grammar (EOS once it is complete), with
        `left` tokens the reply may still take."""
        mask = self.ending.allowed(self.matcher)
        self._left = left
        if not mask.any():
            self.failed = True
            mask[sorted(self.ending.vocab.eos)] = True  # end the reply: its finish says the grammar was not met
            return mask
        if self._looked_at is None or self._looked_at - left >= RECHECK:
            self.ending_tokens = self.ending.search(self.matcher.deep_copy(), self.nesting, left)
            self._looked_at = left
            self._reach = max(self._reach, len(self.ending_tokens or ()))
        return mask

    def draftable(self, drafts: list[int], left: int) -> int:
        """How many of `drafts` to check from here: those the grammar takes, and only while the end is far
        enough that no row after them would need settle(), which sees one token a step."""
        room = self._draft_room(left)
        return self.matcher.validate_tokens(drafts[:room]) if room > 0 else 0

    def _draft_room(self, left: int) -> int:
        """Drafts a row `left` tokens from the end may carry with every row after it still beyond settle()'s reach."""
        return left - self._reach - WINDOW - 1

    def allowed_after(self, ahead: tuple[int, ...]) -> np.ndarray:
        """bool [vocab]: what the grammar allows after the drafts `ahead` (which it takes), the state left as
        it was. If nothing, only EOS, and `dead_after` says so: that row's token must not be taken."""
        assert self.matcher.consume_tokens(list(ahead)), "drafts are checked against the grammar when made"
        try:
            mask = self.ending.allowed(self.matcher)
        finally:
            self.matcher.rollback(len(ahead))
        if not mask.any():
            self.dead_after = min(self.dead_after or len(ahead), len(ahead))
            mask[sorted(self.ending.vocab.eos)] = True
        return mask

    def kept_drafts(self, kept: int, left: int) -> int:
        """Of `kept` drafts that matched their rows, how many may stand: no row past one whose mask was empty,
        and none the end had come near meanwhile (this step's first mask may have found a longer ending)."""
        if self.dead_after is not None:
            kept, self.dead_after = min(kept, self.dead_after - 1), None
        return max(0, min(kept, self._draft_room(left)))

    def settle(self, token: int, left: int, ranked: Callable[[], list[int]]) -> int:
        """The token to take: the sampled `token`, unless the reply could then no longer end within the
        `left` tokens it has; then the best of the model's `ranked` choices that still can, or else the
        ending's next token."""
        ending = self.ending_tokens
        if not ending or left > self._reach + WINDOW:
            return token
        for t in dict.fromkeys([token, *ranked()]):
            if t == ending[0]:
                return t
            after = self.ending.after(self.matcher, self.nesting, t, left - 1)
            if after is not None:
                self._next = (t, after)
                return t
        return ending[0]

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)
        self.nesting = nest(self.nesting, self.ending.vocab.texts[token])
        ending, after = self.ending_tokens, self._next
        self._next = None
        if ending and ending[0] == token:
            self.ending_tokens = ending[1:]
        elif after is not None and after[0] == token:
            self.ending_tokens = after[1]
        else:
            self.ending_tokens = None
            if self._left - 1 <= self._reach + WINDOW:
                self._looked_at = None  # near the end: look again before the next token

    @property
    def done(self) -> bool:
        """Nothing but the end may follow."""
        return self.matcher.is_stopped()
