"""N-gram speculation (prompt lookup): a decoding request proposes the tokens that followed the last
time its latest tokens occurred in its own history, and one step checks them all.

A draft costs rows, not passes over the weights: a step reads every weight once whatever its row count,
so k drafts cost a fraction of a step beside the token they ride with, and each one accepted is a token
without a step of its own. Copy-heavy replies (edits, quotes, re-emitted JSON) accept most of them; free
text accepts few, so each request drafts only as many as its recent acceptance pays for, none while it
is low, and the scheduler drafts only while the step has few rows (server/engine/scheduler.py).

Verification is exact: every row samples as plain decoding would, from the same logits (the kernels are
batch-invariant) and the same uniform draw; a draft is accepted while it equals what its row sampled.
For a deterministic (one-token) proposal that is the standard rejection rule: a draft d is kept with
probability p(d), and a rejected row's token is drawn from p without d, renormalized.
"""
from __future__ import annotations

from dataclasses import dataclass

from .batch import StepBatch

MODES = ("ngram", "off")


@dataclass(frozen=True)
class SpeculationConfig:
    """How requests draft: --speculative, --num-speculative-tokens and the lookup's n-gram sizes."""

    mode: str = "ngram"
    max_draft: int = 7  # draft tokens per request and step (vLLM's num_speculative_tokens)
    max_n: int = 4  # the longest suffix looked up (vLLM's prompt_lookup_max)
    min_n: int = 1  # the shortest (prompt_lookup_min)
    # Rows a step may reach with drafts: past this the step is compute-bound, where a rejected draft costs
    # as much as a token, so many decoding streams draft nothing.
    max_rows: int = 8

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"speculative must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_draft < 1 or not 1 <= self.min_n <= self.max_n or self.max_rows < 2:
            raise ValueError("num_speculative_tokens, the n-gram sizes and max_rows must be positive and ordered")


# How long a draft to check: each draft row costs c of a one-row step (a step reads every weight once, but
# each row adds its own arithmetic), and a draft's tokens stand one after another with the request's
# recent acceptance rate `a`, so k drafts emit (1 - a^(k+1)) / (1 - a) tokens for 1 + c * k. A request
# drafts the k that emits most per cost, when that beats one token a step by GAIN; else it waits `backoff`
# tokens (doubling each time, up to MAX_BACKOFF) and tries again. c is measured as steps run (RowCosts):
# it is small where a step reads its weights from memory, and larger where they sit in the cache;
# ROW_COST stands in until then (a small model's, docs/performance.md).
ROW_COST = 0.25
GAIN = 1.05
PRIOR = 0.6  # the acceptance rate a request starts from, and tries again with after waiting
DECAY = 0.6  # the weight of the past in the rate, per drafted step
FIRST_BACKOFF, MAX_BACKOFF = 8, 256


def best_length(rate: float, limit: int, row_cost: float = ROW_COST) -> int:
    """The draft length (0..limit) that emits the most tokens per unit of step cost at acceptance `rate`."""
    a = min(max(rate, 0.0), 0.99)
    best, best_gain = 0, GAIN
    for k in range(1, limit + 1):
        gain = (1 - a ** (k + 1)) / (1 - a) / (1 + row_cost * k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


class Drafter:
    """One request's n-gram index over its history, and how well its drafts have done."""

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are in _last
        self.rate = PRIOR  # per draft token, the chance it stands (given the ones before it did)
        self._wait = 0  # tokens to go before drafting again
        self._backoff = FIRST_BACKOFF
        self._row_cost = ROW_COST

    def propose(self, history: list[int], limit: int, row_cost: float = ROW_COST) -> list[int]:
        """Up to `limit` tokens to follow `history`: what followed the latest earlier occurrence of its longest
        suffix (max_n down to min_n tokens) that occurred before, as many as pay at its acceptance rate and
        `row_cost` (a draft row's share of a one-row step); none if none did, or while it waits."""
        if self._wait > 0:
            self._wait -= 1
            return []
        self._row_cost = row_cost
        k = best_length(self.rate, min(limit, self.config.max_draft), row_cost)
        if k == 0:
            return []
        self._index(history)
        end = len(history)
        for n in range(min(self.config.max_n, end - 1), self.config.min_n - 1, -1):
            after = self._last.get(tuple(history[end - n :]))
            if after is not None:
                return history[after : after + k]
        return []

    def _index(self, history: list[int]) -> None:
        """Index every n-gram that ends before the history's last token (the suffix being looked up must not
        find itself), each at its latest occurrence."""
        lo, hi = self.config.min_n, self.config.max_n
        for end in range(max(self._indexed, lo), len(history)):  # the n-grams history[end - n : end]
            for n in range(lo, min(hi, end) + 1):
                self._last[tuple(history[end - n : end])] = end
        self._indexed = max(self._indexed, len(history))

    def record(self, drafted: int, accepted: int) -> None:
        """One step's verdict on `drafted` tokens: `accepted` stood, and the next one (if any) did not."""
        tried = accepted + (accepted < drafted)  # the draft tokens whose verdict says something of the rate
        self.rate = DECAY * self.rate + (1 - DECAY) * accepted / tried
        if best_length(self.rate, self.config.max_draft, self._row_cost) > 0:
            self._backoff = FIRST_BACKOFF
            return
        self._wait, self._backoff = self._backoff, min(2 * self._backoff, MAX_BACKOFF)
        self.rate = PRIOR  # when it tries again, it starts over


class RowCosts:
    """A draft row's cost, as a share of a one-row step, from the steps this model has run here: each row
    count's time (a moving average, over steps that only decode, up to max_rows rows), and the slope of time
    over rows through the one-row step's."""

    WEIGHT = 0.2  # of each new step in its row count's average

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._seconds: dict[int, float] = {}  # rows -> a step's time

    def observe(self, batch: StepBatch, seconds: float) -> None:
        rows = batch.n_tokens
        if rows > self.max_rows or any(len(c.tokens) != 1 + c.drafts or not c.sample for c in batch.chunks):
            return  # a prefill's step, or more rows than drafts ever make
        old = self._seconds.get(rows)
        self._seconds[rows] = seconds if old is None else old + self.WEIGHT * (seconds - old)

    def row_cost(self) -> float:
        one = self._seconds.get(1)
        more = [(r - 1, t) for r, t in self._seconds.items() if r > 1]
        if one is None or not more:
            return ROW_COST
        slope = sum(n * (t - one) for n, t in more) / sum(n * n for n, _ in more)
        return min(max(slope / one, 0.01), 1.0)


def accepted_prefix(drafts: tuple[int, ...], sampled: list[int]) -> int:
    """How many drafts stand: drafts[j] is kept while it equals the token row j sampled (row j follows the
    drafts before it), so the step emits sampled[: a + 1] for a kept drafts."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a
