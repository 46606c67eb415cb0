"""The contract between scheduler and runner: which tokens of which sessions one step runs."""
from __future__ import annotations

from dataclasses import dataclass

from kvcache import SessionCache

from .sampling import SampleRow


@dataclass(frozen=True)
class Chunk:
    """Consecutive pending tokens of one session; `sample` asks for the next token after them."""

    request_id: str
    session_id: str
    cache: SessionCache  # the session's KV, which the step extends by `tokens`
    tokens: tuple[int, ...]
    start: int  # position of tokens[0] (== the session's cached length before the step)
    sample: bool
    # A request that scores its prompt (echo with logprobs): the prompt tokens its first rows predict, row j
    # the one after tokens[j] (its last row's is the next chunk's first); the runner returns each one's
    # logprob with the row's top `scored_top`. Empty for every other chunk, which adds no logit rows.
    scored: tuple[int, ...] = ()
    scored_top: int = 0


@dataclass(frozen=True)
class StepBatch:
    """Everything one forward runs, in the order of the flat token axis."""

    chunks: tuple[Chunk, ...] = ()
    rows: tuple[SampleRow, ...] = ()  # what the sampler needs, one per chunk that samples, in order

    @property
    def n_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)
