"""Closing in time: the shortest way to finish a constrained reply from where it stands.

A reply held to a grammar (JSON, a schema, tool calls) that runs out of `max_tokens` mid-object is
useless to an agent. So once the tokens left come near the shortest way to the grammar's end, each
sampled token is checked: if the reply could no longer end within its budget after it, the best of the
model's next choices that still can is taken, or else the first token of that shortest ending. A reply
ends `length` only when even the shortest ending never fitted.

llguidance gives the tokens the grammar allows next, not the distance to its end, so the ending is
searched greedily: forced tokens first; then, among a short list of closing and minimal-value tokens,
one that completes the grammar, else the one that leaves the fewest strings and brackets open (JSON's
nesting, read from the text); failing those, any allowed token by the same rule, longest first.
Greedy is not always shortest, but every step it takes is one the grammar allows, so an ending it finds
is a real one.
"""
from __future__ import annotations

from dataclasses import dataclass

import llguidance
import numpy as np

# Closing tokens first, then separators and the shortest values, in the order they are preferred.
SHORT_TEXTS = ['"}}', '"]}', '"}]', '}]}', '"}', '"]', '}}', ']}', '}]', '"', '}', ']',
               ',', '0', '""', '{}', '[]', 'null', 'true', 'false']
MAX_ENDING = 256  # longest ending searched for: a reply this far from any end is not closed early
MAX_TRIED = 512  # allowed tokens weighed at a step with no short-list token allowed
MAX_WORK = 4096  # tokens tried in all, per search: a grammar with no end in sight costs a bounded search
WINDOW = 8  # sampled tokens are checked from this many tokens (plus the ending's own length) before the end

Nesting = tuple[int, bool, bool]  # JSON's open brackets, inside a string, after a backslash
OPEN: Nesting = (0, False, False)


def nest(state: Nesting, text: str) -> Nesting:
    depth, in_string, escaped = state
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth = max(0, depth - 1)
    return depth, in_string, escaped


def _distance(state: Nesting) -> int:
    return state[0] + state[1]


@dataclass(frozen=True)
class Vocabulary:
    """A tokenizer's token texts, the short list's ids in order of preference, and its end tokens."""

    texts: tuple[str, ...]
    short: np.ndarray  # int64 [k]
    eos: frozenset[int]

    @staticmethod
    def of(texts: list[str], eos: frozenset[int]) -> Vocabulary:
        ids = {t: i for i, t in reversed(list(enumerate(texts)))}
        wanted = [w for text in SHORT_TEXTS for w in (text, " " + text)]
        short = [ids[w] for w in wanted if w in ids and ids[w] not in eos]
        return Vocabulary(tuple(texts), np.array(short, dtype=np.int64), eos)


class Ending:
    """The search for the shortest ending, over one matcher's copy; masks go into one reused buffer."""

    def __init__(self, vocab: Vocabulary, n_vocab: int) -> None:
        self.vocab, self.n_vocab = vocab, n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
        self._work = MAX_WORK

    def allowed(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """bool [vocab]: what the grammar allows next."""
        matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)

    def after(self, matcher: llguidance.LLMatcher, state: Nesting, token: int, limit: int) -> list[int] | None:
        """The shortest ending found once `token` follows, or None if it is past `limit` tokens or the
        grammar refuses the token."""
        m = matcher.deep_copy()
        if token in self.vocab.eos:
            return [] if m.is_accepting() else None
        if not m.consume_token(token) or m.is_error():
            return None
        return self.search(m, nest(state, self.vocab.texts[token]), limit)

    def search(self, matcher: llguidance.LLMatcher, state: Nesting, limit: int) -> list[int] | None:
        """The tokens that end the reply from `matcher`'s state (consumed: pass a copy), the end token
        last where the grammar needs one; None if none was found within `limit` tokens."""
        texts, path = self.vocab.texts, []
        limit, self._work = min(limit, MAX_ENDING), MAX_WORK
        while not matcher.is_stopped():
            if matcher.is_accepting():
                eos = sorted(self.vocab.eos)
                return path + eos[:1] if eos and len(path) < limit else None
            forced = matcher.compute_ff_tokens()
            if forced:
                if len(path) + len(forced) > limit or not matcher.consume_tokens(forced):
                    return None
                path += forced
                state = nest(state, "".join(texts[t] for t in forced))
                continue
            if len(path) >= limit:
                return None
            token = self._step(matcher, state) if self._work > 0 else None
            if token is None or not matcher.consume_token(token):
                return None
            path.append(token)
            state = nest(state, texts[token])
        return path

    def _step(self, matcher: llguidance.LLMatcher, state: Nesting) -> int | None:
        allowed = self.allowed(matcher)
        short = self.vocab.short[allowed[self.vocab.short]]
        if len(short):
            tried = short.tolist()
        else:
            ids = np.flatnonzero(allowed)
            tried = sorted((t for t in ids.tolist() if t not in self.vocab.eos),
                           key=lambda t: -len(self.vocab.texts[t]))[:MAX_TRIED]
        best, best_key = None, None
        tried = tried[: self._work]
        self._work -= len(tried)
        for rank, token in enumerate(tried):
            if matcher.try_consume_tokens([token]) != 1:
                continue
            done = matcher.is_accepting()
            matcher.rollback(1)
            if done:
                return token
            key = (_distance(nest(state, self.vocab.texts[token])), rank)
            if best_key is None or key < best_key:
                best, best_key = token, key
        return best
