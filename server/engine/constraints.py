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
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from models.tokenizer import TextTokenizer

from ..errors import InvalidRequest


# Fixed separators and no free whitespace in generated JSON: a small model otherwise pads it with
# newlines and indentation until max_tokens.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """Compiles output constraints for one tokenizer (its llguidance view is built on first use)."""

    def __init__(self, tokenizer: TextTokenizer, max_context: int) -> None:
        self._tokenizer, self.max_context = tokenizer, max_context
        self._ll: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                tok = self._tokenizer
                self._ll = llguidance.LLTokenizer(tok.tokenizer.to_str(), n_vocab=tok.vocab_size,
                                                  eos_token=sorted(tok.eos_ids) or None)
            return self._ll

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
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        except Exception as e:  # the GBNF converter raises plain exceptions on bad input
            raise InvalidRequest(f"the grammar does not parse: {e}", param=param) from None

    @staticmethod
    def choice(options: list[str]) -> str:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))

    @staticmethod
    def tool_calls(tools: list[dict], parallel: bool) -> str:
        """One or more (or exactly one) `<tool_call>` blocks, each a JSON call of one of `tools`."""
        calls = [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
        schema = json.dumps({**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_LAYOUT})
        lark = f'start: call{"+" if parallel else ""}\ncall: "<tool_call>\\n" %json {schema} "\\n</tool_call>\\n"'
        return llguidance.LLMatcher.grammar_from_lark(lark)

    # ---- matchers ------------------------------------------------------------------------------
    def check(self, grammar: str, param: str) -> str:
        """Raise a 400 naming the problem if `grammar` does not compile, or if no output can ever satisfy it:
        its language is empty, or it forces more tokens than the context holds. Returns it."""
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error and not error.startswith("WARNING"):
            raise InvalidRequest(f"invalid {param}: {error.strip()}", param=param)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        matcher.compute_logit_bias()  # an empty language shows once the first mask is asked for
        if matcher.is_error():
            raise InvalidRequest(f"invalid {param}: no output can match it (its language is empty)", param=param)
        if _forces_past(matcher, self.max_context):
            raise InvalidRequest(f"invalid {param}: no output can complete it: it forces more than the context of "
                                 f"{self.max_context} tokens before it could end (a rule that must always recur?)",
                                 param=param)
        return grammar

    def matcher(self, grammar: str | None) -> Constraint | None:
        """A request's grammar state (None for no grammar). Compiled in the handler's thread, before it
        takes the engine's lock, which the model thread would otherwise wait on."""
        if grammar is None:
            return None
        return Constraint(llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0), self._tokenizer.vocab_size)


def _forces_past(matcher: llguidance.LLMatcher, limit: int) -> bool:
    """Whether the grammar forces more than `limit` tokens from its start, with no choice that could end it
    (say `start: "a" start`), or a forced run longer than its parser can follow. llguidance gives a forced
    run in bounded pieces: take them until one ends it or the limit is passed."""
    forced = 0
    while not matcher.is_accepting():
        tokens = matcher.compute_ff_tokens()
        if not tokens:
            return False  # a choice comes next: whether it can end is not known here
        forced += len(tokens)
        if forced > limit or not matcher.consume_tokens(tokens):
            return True
    return False


class Constraint:
    """One request's grammar state: the tokens it allows next, advanced by each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int) -> None:
        self.matcher, self.vocab = matcher, vocab
        self._bits = np.zeros((vocab + 31) // 32, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens that keep the output within the grammar (EOS once it is complete)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

    def accept(self, token: int) -> None:
        self.matcher.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing but the end may follow."""
        return self.matcher.is_stopped()
