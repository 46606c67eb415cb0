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
