"""Constrained decoding: what a request's output must match (JSON schema, regex, Lark/GBNF grammar, tool
calls), compiled by llguidance into a matcher that gives the tokens allowed next.

llguidance rather than xgrammar or outlines-core: it installs here as one Rust wheel with no
dependencies, reads `tokenizer.json` directly, and computes a row's mask in a small fraction of a step, so
masks for a step are computed while its forward runs.

A client's constraint is checked in three stages, so that none can crash or freeze the server: its size
and depth first (constraint_limits.py), then a first compile in a child process under a time budget
(grammar_worker.py), and only then a compile here, off the event loop, kept for the request's matchers.
A mask that overruns its own budget ends its reply as one that cannot meet the grammar.
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from models.tokenizer import TextTokenizer

from ..errors import InvalidRequest
from .closing import MAX_ENDING, OPEN, WINDOW, Ending, Vocabulary, nest
from .forced_calls import JSON_LAYOUT, Layout, OfferedCalls, hermes, marker_term
from .constraint_limits import check_grammar, check_regex, check_schema, check_size, check_tools
from .grammar_ends import can_end
from .grammar_worker import LIMITS, ConstraintRefused, GrammarWorkers


RECHECK = 16  # tokens between looks for the shortest ending while the end is still far
WORKERS = 2  # children checking grammars at once: one slow grammar leaves the other for everyone else
COMPILED = 64  # grammars kept compiled, the most recent: agents send the same tool list turn after turn


class Grammars:
    """Compiles output constraints for one tokenizer (its llguidance view is built on first use)."""

    def __init__(self, tokenizer: TextTokenizer, max_context: int, compile_budget_s: float = 10.0,
                 mask_budget_s: float = 2.0) -> None:
        self._tokenizer, self.max_context = tokenizer, max_context
        self.mask_budget_s = mask_budget_s
        self._ll: llguidance.LLTokenizer | None = None
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()
        # the children's view of the tokenizer is written once the first child starts, not at every start-up
        self.workers = GrammarWorkers(lambda: {"json": tokenizer.tokenizer.to_str(), "n_vocab": tokenizer.vocab_size,
                                               "eos": sorted(tokenizer.eos_ids) or None}, WORKERS, compile_budget_s)
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

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
            check_size(schema, param)
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as e:
                raise InvalidRequest(f"the JSON schema is not JSON: {e}", param=param) from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest("a JSON schema must be an object", param=param)
        check_schema(schema, param)
        return _compiled_text(lambda: llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT),
                              param)

    @staticmethod
    def regex(pattern: str, param: str = "guided_regex") -> str:
        check_regex(pattern, param)
        return _compiled_text(lambda: llguidance.LLMatcher.grammar_from_regex(pattern), param)

    @staticmethod
    def lark(text: str, param: str) -> str:
        """A Lark grammar, or GBNF (llama.cpp's format), which llguidance converts."""
        check_grammar(text, param)
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
    def choice(options: list[str], param: str = "guided_choice") -> str:
        lark = "start: " + " | ".join(json.dumps(o) for o in options)
        check_size(lark, param)
        return _compiled_text(lambda: llguidance.LLMatcher.grammar_from_lark(lark), param)

    def tool_calls(self, tools: list[dict], parallel: bool, layout: Layout = hermes, param: str = "tools") -> str:
        """A forced reply: one or more (or exactly one) calls of `tools`, laid out in the model's format."""
        check_tools(len(tools), param)
        for i, t in enumerate(tools):
            check_schema(t["parameters"], f"{param}[{i}].parameters")
        offered = OfferedCalls(tuple(t["name"] for t in tools), tuple(t["parameters"] for t in tools),
                               marker_term(self._tokenizer))
        lark = layout(offered, parallel)
        check_size(lark, param)
        return _compiled_text(lambda: llguidance.LLMatcher.grammar_from_lark(lark), param)

    # ---- matchers ------------------------------------------------------------------------------
    def check(self, grammar: str, param: str) -> str:
        """Raise a 400 naming the problem if `grammar` does not compile, if no output can ever satisfy it (its
        language is empty, or it forces more tokens than the context holds), or if compiling it crashed the
        grammar library or overran the budget; else compile it here for the request's matchers. Blocks for
        up to the budget: call it off the event loop. Returns the grammar."""
        with self._lock:
            if grammar in self._compiled:  # checked and compiled already (an agent's tool list, turn after turn)
                self._compiled.move_to_end(grammar)
                return grammar
        try:
            self.workers.check(grammar, self.max_context)
        except ConstraintRefused as e:
            raise InvalidRequest(f"invalid {param}: {e}", param=param) from None
        compiled = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=LIMITS)
        with self._lock:
            self._compiled[grammar] = compiled
            while len(self._compiled) > COMPILED:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, grammar: str | None) -> Constraint | None:
        """A request's grammar state (None for no grammar): a copy of the one check() compiled."""
        if grammar is None:
            return None
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
        matcher = (compiled.deep_copy() if compiled is not None else
                   llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=LIMITS))
        return Constraint(matcher, Ending(self.vocabulary, self._tokenizer.vocab_size), self.mask_budget_s)

    def close(self) -> None:
        self.workers.close()


def _compiled_text(build: Callable[[], str], param: str) -> str:
    """A grammar from llguidance's converters, whose errors on bad input are plain exceptions."""
    try:
        return build()
    except RecursionError:
        raise InvalidRequest(f"invalid {param}: it nests too deeply to read", param=param) from None
    except (ValueError, TypeError, RuntimeError) as e:
        raise InvalidRequest(f"invalid {param}: {str(e)[:500]}", param=param) from None


class Constraint:
    """One request's grammar state: the tokens it allows next, advanced by each sampled token, and the
    shortest ending from here, so that a reply near its last tokens closes in time (closing.py)."""

    def __init__(self, matcher: llguidance.LLMatcher, ending: Ending, budget_s: float = float("inf")) -> None:
        self.matcher, self.ending, self.budget_s = matcher, ending, budget_s
        self.nesting = OPEN
        self.ending_tokens: list[int] | None = None  # the shortest ending found from here (None: none in reach)
        self._looked_at: int | None = None  # the tokens left when it was looked for; None: look again
        self._next: tuple[int, list[int]] | None = None  # the token settle() let through, and the ending after it
        # the longest ending seen in this reply: what one token that opens a new structure (another tool
        # call, a nested object) may cost, so sampled tokens are checked from that far before the end
        self._reach = 0
        self._left = 0  # the tokens left at the last mask
        self.failed = False  # the grammar allowed no token at all (or a mask overran): the reply cannot meet it
        self.dead_after: int | None = None  # this step's first draft row whose grammar allowed nothing

    def check_fits(self, max_tokens: int) -> None:
        """Refuse (InvalidRequest) a reply whose grammar's shortest output found from the start takes more
        than its `max_tokens`: a forced tool call could only end cut off, with no call."""
        if max_tokens >= MAX_ENDING:
            return
        if self.ending.search(self.matcher.deep_copy(), self.nesting, max_tokens) is not None:
            return
        shortest = self.ending.search(self.matcher.deep_copy(), self.nesting, MAX_ENDING)
        if shortest is not None:
            raise InvalidRequest(f"max_tokens {max_tokens} is too few for the forced tool call: its shortest form "
                                 f"takes {len(shortest)} tokens", param="max_tokens")

    def allowed(self, left: int) -> np.ndarray:
        """bool [vocab]: the tokens that keep the output within the grammar (EOS once it is complete), with
        `left` tokens the reply may still take. A mask that took longer than the budget ends the reply
        (finish "unmet"): the step waits on every row's mask, so one costly grammar would slow every tenant."""
        began = time.monotonic()
        mask = self.ending.allowed(self.matcher)
        self._left = left
        if mask.any() and (self._looked_at is None or self._looked_at - left >= RECHECK):
            self.ending_tokens = self.ending.search(self.matcher.deep_copy(), self.nesting, left)
            self._looked_at = left
            self._reach = max(self._reach, len(self.ending_tokens or ()))
        if not mask.any() or time.monotonic() - began > self.budget_s:
            self.failed = True
            mask[:] = False
            mask[sorted(self.ending.vocab.eos)] = True  # end the reply: its finish says the grammar was not met
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
