"""A Sequence: one generation request as it flows through scheduler, step batch and runner, with its
session, sampling state and the token-level conditions that end it. Its text is made off the engine,
by the request's OutputStream."""
from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from .constraints import Constraint
from .drafts import Drafter, accepted_prefix
from .mirostat import MirostatState
from .sampling import Sampled, SampleRow, SamplingParams
from .session import Session


@dataclass(frozen=True)
class Scheduling:
    """How a request runs besides its sampling: its place in its tenant's queue, how long it may take from
    arrival, whether it drafts, and the prefix-cache namespace it reads and writes within its tenant's."""

    priority: int = 0  # lower goes first (as vLLM's `priority`)
    timeout: float | None = None  # seconds; None: only --request-timeout, if set
    speculative: bool | None = None  # whether it drafts tokens (server/engine/drafts.py); None: --speculative
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefixes


@dataclass(frozen=True)
class TokenEvent:
    """A sampled token and, once its OutputStream has rendered it, the text it makes final (may be empty
    while held back)."""

    token: int
    text: str = ""
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    ends_text: bool = False  # an end token (EOS or a stop token id): it ends the reply and shows no text


@dataclass(frozen=True)
class Finished:
    """The end of a request, with its usage."""

    # "eos" | "stop" | "length" | "timeout" (its deadline passed while it ran) | "cancelled" | "error"
    # | "shutdown" (the server's drain outlasted --shutdown-timeout: the server ended it, with its tokens so far)
    # | "unmet" (its output constraint could not be met)
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: Exception | None = None
    last: TokenEvent | None = None  # the token that ended the request, if one did: it comes with the end
    text: str = ""  # rendered: text released at the end (the held-back tail, if no stop string matched)
    output: str = ""  # rendered: the whole reply's text
    embedding: torch.Tensor | None = None  # an embedding request's pooled vector, L2-normalized (float32 [dim])


@dataclass(eq=False)
class Sequence:
    """State of one request from submission to its Finished event."""

    session: Session
    params: SamplingParams
    prompt_tokens: int  # tokens of this request's prompt
    cached_tokens: int = 0  # of which were not prefilled (session KV or cached prefix), known once admitted
    id: str = field(default_factory=lambda: "req-" + secrets.token_hex(8))
    parent: Sequence | None = None  # for the other choices of an n > 1 request: the one that prefills the prompt
    constraint: Constraint | None = None  # the grammar its output must match, if any
    history_before: list[int] = field(default_factory=list)  # the session's history before this request
    kept: int = 0  # how much of history_before the request kept
    prompt_ids: list[int] = field(default_factory=list)  # the history it starts from (repetition penalty)
    output_ids: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Where accept/finish put events; None: straight into `events`. The engine, whose steps run off the
    # event loop, collects them and hands them over to the loop once a step.
    sink: Callable[[asyncio.Queue, object], None] | None = None
    finished: Finished | None = None
    cancelled: bool = False
    cancel_reason: str = "cancelled"  # what it ends with once cancelled: "shutdown" where the server's drain ended it
    stop_at: int | None = None  # a stop string found while a step ran it: end after this many tokens, once it ends
    fetch: Future | None = None  # its history's blocks being read back from disk: it waits in the queue meanwhile
    priority: int = 0  # within its tenant, lower goes first (as vLLM's `priority`)
    drafter: Drafter | None = None  # its n-gram drafts, if it speculates (server/engine/drafts.py)
    timeout: float | None = None  # seconds from arrival to its deadline; None: none
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Its prompt's logprobs (params.prompt_logprobs), by the position of the token scored, as its prefill
    # runs; complete before its first event, which is when the API reads them
    scores: dict[int, Sampled] = field(default_factory=dict)
    # An embedding request ("mean" or "last"; it generates nothing): its prompt's final normed hidden states
    # pooled so far, in float64 (their sum, or the last row), through position `pooled_to`
    pooling: str | None = None
    pool_state: torch.Tensor | None = None
    pooled_to: int = 0

    def __post_init__(self) -> None:
        seed = self.params.seed if self.params.seed is not None else secrets.randbits(62)
        self.generator = torch.Generator().manual_seed(seed)
        # mirostat's mu, carried from step to step as the generator is (each choice of n has its own)
        self.mirostat = MirostatState.start(self.params) if self.params.mirostat else None
        self._drawn_from: torch.Tensor | None = None  # its generator's state before a drafted step's draws

    def admitted(self, cached_length: int) -> None:
        """First admission: the session holds KV for its first `cached_length` tokens."""
        self.admitted_at = time.monotonic()
        self.cached_tokens = max(0, cached_length - self.prompt_start)

    def past_deadline(self, now: float) -> bool:
        return self.timeout is not None and now >= self.arrival + self.timeout

    @property
    def prompt_start(self) -> int:
        """Where this request's prompt begins in its history."""
        return len(self.prompt_ids) - self.prompt_tokens

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill still owes its prompt's logprobs: it then runs every prompt token itself, as no
        KV it did not compute (a cached prefix, the session's kept history) comes with logits. Of the
        choices of n, only the first computes them."""
        return self.params.prompt_logprobs is not None and self.parent is None and len(self.scores) < self.prompt_tokens - 1

    @property
    def runs_prompt(self) -> bool:
        """Whether it still runs its whole prompt itself: KV it did not compute (a cached prefix, the session's
        kept history) comes with neither the logits its prompt's logprobs need nor the hidden states an
        embedding pools."""
        return self.scores_prompt or (self.pooling is not None and self.pooled_to < len(self.prompt_ids))

    @property
    def reuse_limit(self) -> int | None:
        """How much of its history may start from KV it did not compute; None: all of it."""
        return self.prompt_start if self.runs_prompt else None

    def prompt_targets(self, start: int, n: int) -> tuple[int, ...]:
        """The tokens of its history that rows start..start+n-1 predict, if it scores its prompt (row j predicts
        token j + 1; the prompt's last row predicts none)."""
        return tuple(self.prompt_ids[start + 1 : start + n + 1]) if self.scores_prompt else ()

    def scored(self, start: int, rows: list[Sampled]) -> None:
        """The logprobs of the tokens after rows start.. (rows run again after a preemption give the same)."""
        for position, s in enumerate(rows, start + 1):
            if position > self.prompt_start:
                self.scores[position] = s

    @property
    def prompt_logprobs(self) -> list[Sampled | None] | None:
        """Its prompt's logprobs, token by token (the first has none), once known (another choice of n: its
        first choice's); None if it asked for none or they never came (the first choice ended early)."""
        owner = self.parent or self
        if owner.params.prompt_logprobs is None or owner.scores_prompt:
            return None
        return [None, *(owner.scores[p] for p in range(owner.prompt_start + 1, len(owner.prompt_ids)))]

    def pooled_rows(self, start: int, n: int) -> int:
        """How many of rows start..start+n-1 (the last ones) an embedding pools: every row for mean pooling,
        the prompt's last row for last-token pooling."""
        if self.pooling is None:
            return 0
        return n if self.pooling == "mean" else int(start + n == len(self.prompt_ids))

    def pool(self, end: int, rows: torch.Tensor) -> None:
        """Take the final normed hidden states of positions end - len(rows)..end - 1 [k, dim] into its pooled
        vector. Rows run again after a preemption are the ones already taken, and are skipped."""
        first = end - len(rows)
        skip = max(self.pooled_to, self.prompt_start) - first
        if skip >= len(rows):
            return
        assert self.pooling == "last" or skip >= 0, "an embedding's rows are pooled in order, none skipped"
        rows = rows[max(skip, 0) :].double()
        if self.pooling == "last" or self.pool_state is None:
            self.pool_state = rows[-1] if self.pooling == "last" else rows.sum(0)
        else:
            self.pool_state = self.pool_state + rows.sum(0)
        self.pooled_to = end

    @property
    def embedding(self) -> torch.Tensor | None:
        """Its pooled vector, L2-normalized (float32 [dim]), once its whole prompt has run; None before. The mean
        is the sum scaled, so the sum normalizes to the same vector."""
        if self.pooling is None or self.pool_state is None or self.pooled_to < len(self.prompt_ids):
            return None
        return torch.nn.functional.normalize(self.pool_state, dim=0).float()

    def draft(self, limit: int, row_cost: float) -> tuple[int, ...]:
        """Up to `limit` tokens to check after its pending one in this step: as many as pay at `row_cost` (a
        draft row's share of a one-row step), its reply and its session still have room for, and its grammar
        takes."""
        if self.drafter is None:
            return ()
        left = self.params.max_tokens - len(self.output_ids)
        room = min(limit, left - 1, self.session.capacity - len(self.session.tokens))
        drafts = self.drafter.propose(self.session.tokens, room, row_cost)
        if self.constraint is not None and drafts:
            drafts = drafts[: self.constraint.draftable(drafts, left)]
        return tuple(drafts)

    def sample_rows(self, drafts: tuple[int, ...] = ()) -> list[SampleRow]:
        """What the sampler needs for its step's rows: one, or one after each of its drafts too, each row's
        reply taken as if the drafts before it stood."""
        if drafts and not self.params.greedy:
            self._drawn_from = self.generator.get_state()
        return [SampleRow(self.params, self.generator, self.prompt_ids, [*self.output_ids, *drafts[:j]] if j else self.output_ids,
                          self.constraint, drafts[:j], self.mirostat) for j in range(len(drafts) + 1)]

    def check_drafts(self, drafts: tuple[int, ...], sampled: list[Sampled]) -> list[Sampled]:
        """A drafted step's verdict -> the tokens it emits: the drafts that equal what their rows sampled, then
        the next row's token. The KV of the drafts rejected goes; the generator is left as if each emitted
        token had taken its step alone."""
        kept = accepted_prefix(drafts, [s.token for s in sampled])
        self.drafter.record(len(drafts), kept)
        if self.constraint is not None:
            kept = self.constraint.kept_drafts(kept, self.params.max_tokens - len(self.output_ids))
        self.session.truncate_cache(len(self.session.tokens) + kept)  # the pending token's KV, then the kept drafts'
        if self._drawn_from is not None:
            self.generator.set_state(self._drawn_from)
            for _ in range(kept + 1):
                torch.rand(1, generator=self.generator)
            self._drawn_from = None
        return sampled[: kept + 1]

    @property
    def wants_tokens(self) -> bool:
        return len(self.output_ids) < self.params.max_tokens

    def accept(self, s: Sampled, eos_ids: frozenset[int]) -> None:
        """Append a sampled token to the session and the events; finish when a token-level condition holds
        (stop strings are matched on the text, by the OutputStream)."""
        now = time.monotonic()
        self.first_token_at = self.first_token_at or now
        self.last_token_at = now
        self.output_ids.append(s.token)
        self.session.tokens.append(s.token)
        if self.constraint is not None:
            self.constraint.accept(s.token)
        is_eos = s.token in eos_ids and not self.params.ignore_eos
        stop_token = s.token in self.params.stop_token_ids
        event = TokenEvent(s.token, logprob=s.logprob, top=s.top, ends_text=is_eos or stop_token)
        if self.constraint is not None and self.constraint.failed:
            self.finish("unmet", last=event)  # its grammar allowed nothing more: the output does not meet it
        elif is_eos or (self.constraint is not None and self.constraint.done):
            self.finish("eos", last=event)  # the reply ended by itself (or its grammar did)
        elif stop_token:
            self.finish("stop", last=event)  # one of the request's own stop tokens
        elif not self.wants_tokens or len(self.session.tokens) >= self.session.capacity:
            self.finish("length", last=event)
        else:
            self._emit(event)

    def accept_all(self, tokens: list[Sampled], eos_ids: frozenset[int]) -> int:
        """Accept a step's tokens in order until one ends the request -> how many it took."""
        for n, s in enumerate(tokens, 1):
            self.accept(s, eos_ids)
            if self.finished is not None:
                return n
        return len(tokens)

    def finish(self, reason: str, error: Exception | None = None, last: TokenEvent | None = None) -> None:
        if self.finished is not None:
            return
        self.finished = Finished(reason, self.prompt_tokens, len(self.output_ids), self.cached_tokens, error, last,
                                 embedding=self.embedding if error is None else None)
        self._emit(self.finished)

    def end_at(self, kept: int) -> None:
        """End at a stop string its OutputStream found after `kept` output tokens: the tokens sampled past it
        leave the history and the KV (only between steps: no step may be writing them). A request that had
        already ended by itself trims the history only if it is still what the request left."""
        session, end = self.session, self.finished
        ours = end is None or (
            end.reason in ("eos", "stop", "length") and session.busy is None
            and session.tokens == [*self.prompt_ids, *self.output_ids]
        )
        if ours and kept < len(self.output_ids):
            del self.output_ids[kept:]
            session.truncate(len(self.prompt_ids) + kept)
        self.finish("stop")

    def _emit(self, event: TokenEvent | Finished) -> None:
        if self.sink is None:
            self.events.put_nowait(event)
        else:
            self.sink(self.events, event)
