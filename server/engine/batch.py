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
    # Speculation: the last `drafts` tokens are proposed, not yet the session's; a sampling chunk then
    # samples every row from its last history token on (1 + drafts rows), and its results say which stand.
    drafts: int = 0
    # An embedding request's chunk: its last `pooled` rows' final normed hidden states come back from the
    # runner, for the request to pool (every row for mean pooling, the prompt's last for last-token).
    pooled: int = 0

    @property
    def draft_tokens(self) -> tuple[int, ...]:
        return self.tokens[len(self.tokens) - self.drafts :]

    @property
    def sampled_rows(self) -> int:
        """Rows of this chunk the sampler gets: 0, 1, or 1 + drafts."""
        return 1 + self.drafts if self.sample else 0


@dataclass(frozen=True)
class StepBatch:
    """Everything one forward runs, in the order of the flat token axis."""

    chunks: tuple[Chunk, ...] = ()
    rows: tuple[SampleRow, ...] = ()  # what the sampler needs, one per sampled row (Chunk.sampled_rows), in order

    @property
    def n_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.chunks)

    def __bool__(self) -> bool:
        return bool(self.chunks)
