"""A constraint's first compile, in a child process under a time budget: a grammar that crashes the grammar
library (a stack overflow in its Rust code is a segfault, which no `except` catches) or that would take
minutes to compile costs its own request a 400 and one child, never the server.

The parent keeps a few children, each holding the tokenizer's llguidance view; a check takes an idle one,
sends the grammar and waits up to the budget. A child that dies or overruns is killed and replaced on
next use. Only a grammar the child compiled and masked once in time is compiled in the server itself.

The child runs `python -m server.engine.grammar_worker`, which imports llguidance and nothing else of
ours: no torch, so it starts quickly. Messages are one JSON line each way.
"""
from __future__ import annotations

import json
import os
import queue
import select
import subprocess
import sys
import time
from collections.abc import Callable

import llguidance

# llguidance's parser refuses a row of more than 2,000 Earley items by default, and a choice among more
# alternatives than that (an enum of names as a grammar) is one such row once its first byte is read: the
# reply failed there. A wider row is allowed, while step_max_items still bounds what any one mask may cost.
# Errors stay short: a verbose one quotes the whole grammar back to the client.
LIMITS = llguidance.LLParserLimits(max_items_in_row=20_000, verbose_errors=False)


STARTUP_S = 120.0  # a child's start and tokenizer: not part of any grammar's budget, but bounded


class ConstraintRefused(Exception):
    """The grammar cannot serve a request; the message says why, for the client."""


def verdict(grammar: str, tokenizer: llguidance.LLTokenizer, max_context: int) -> str | None:
    """Why no reply could meet `grammar` (it does not compile, its language is empty, it forces more tokens
    than the context holds, or the parser cannot follow it), or None when it can serve a request."""
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=LIMITS)
    if error and not error.startswith("WARNING"):
        return error.strip()
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=LIMITS)
    matcher.compute_logit_bias()  # an empty language shows once the first mask is asked for
    if matcher.is_error() and reason(matcher) == "NoExtensionBias":  # no token at all may come first
        return "no output can match it (its language is empty)"
    if not matcher.is_error() and _forces_past(matcher, max_context):
        return (f"no output can complete it: it forces more than the context of {max_context} tokens before "
                "it could end (a rule that must always recur?)")
    if matcher.is_error():  # one of the parser's limits, met where a reply would meet it too
        return f"the grammar engine cannot follow it: {reason(matcher)}"
    return None


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


def reason(matcher: llguidance.LLMatcher) -> str:
    """The matcher's error, without the marker llguidance puts where the verbose part would be."""
    return matcher.get_error().replace("<non-verbose/>", "").strip()


class _Child:
    """One worker process and its pipes."""

    def __init__(self, tokenizer: Callable[[], dict]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.send(tokenizer())
        if self.receive(time.monotonic() + STARTUP_S) is None:  # the tokenizer is built before any grammar
            self.kill()
            raise OSError("the grammar worker did not start")

    def send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict | None:
        """The child's answer, or None if it died or the deadline passed first."""
        out = self.proc.stdout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if ready:
                line = out.readline()
                return json.loads(line) if line else None
        return None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class GrammarWorkers:
    """`size` children that check grammars; a caller blocks (off the event loop) until one answers."""

    def __init__(self, tokenizer: Callable[[], dict], size: int, budget_s: float) -> None:
        self._tokenizer, self.budget_s = tokenizer, budget_s
        self._idle: queue.LifoQueue[_Child | None] = queue.LifoQueue()  # a warm child is taken first
        for _ in range(size):
            self._idle.put(None)  # started on first use: a child costs a Python start and a tokenizer

    def check(self, grammar: str, max_context: int) -> None:
        """Raise ConstraintRefused if the grammar cannot serve a request, or if checking it crashed the
        grammar library or took longer than the budget."""
        try:
            child = self._idle.get(timeout=self.budget_s)
        except queue.Empty:
            raise ConstraintRefused(f"other constraints are being compiled; none was free within the "
                                    f"{self.budget_s:g} s budget") from None
        deadline = time.monotonic() + self.budget_s
        try:
            if child is None or child.proc.poll() is not None:
                child = None
                child = _Child(self._tokenizer)
                deadline = time.monotonic() + self.budget_s  # a new child's start is not the grammar's cost
            child.send({"grammar": grammar, "max_context": max_context})
            answer = child.receive(deadline)
        except OSError:
            answer = None
        if answer is None:
            timed_out = time.monotonic() >= deadline
            if child is not None:
                child.kill()
            self._idle.put(None)
            if timed_out:
                raise ConstraintRefused(f"compiling it took longer than the {self.budget_s:g} s budget "
                                        "(--constraint-timeout)")
            raise ConstraintRefused("the grammar engine failed on it (it is too deep or too large to compile)")
        self._idle.put(child)
        if answer["error"] is not None:
            raise ConstraintRefused(answer["error"])

    def close(self) -> None:
        """Stop the idle children. One still checking a grammar is not waited for: it ends when its pipe
        closes with this process."""
        while True:
            try:
                child = self._idle.get_nowait()
            except queue.Empty:
                return
            if child is not None:
                child.kill()


def _serve() -> None:
    # answers go out on the pipe alone: whatever the library prints goes to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    first = sys.stdin.readline()
    if not first:
        return
    spec = json.loads(first)
    tokenizer = llguidance.LLTokenizer(spec["json"], n_vocab=spec["n_vocab"], eos_token=spec["eos"])
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            error = verdict(request["grammar"], tokenizer, request["max_context"])
        except Exception as e:  # llguidance raises on some malformed grammars instead of reporting
            error = f"the grammar does not compile: {e}"
        out.write(json.dumps({"error": error}) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
