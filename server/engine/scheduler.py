"""Continuous batching: which requests run in the next step, within token, session and KV budgets.

Requests are served first come, first served. Each step first gives every running decode its one
token, so streams keep pace however many prompts wait; the rest of the token budget goes to prefill
chunks, of running requests (oldest first) and then of waiting ones as they are admitted. An admitted
request's session starts from the longest cached prefix of its history (or from its parent's KV, for
the choices of one `n` > 1 request), so only the rest is prefilled. KV blocks come from the pool's free
and cached blocks, then from evicting idle sessions (least recently used first) and, failing that,
from preempting the youngest running request, whose KV is dropped and recomputed later.
"""
from __future__ import annotations

import time
from collections import deque

from kvcache import PoolExhausted, Sizing

from ..config import EngineConfig
from ..errors import Overloaded, StepFailed
from .batch import Chunk, StepBatch
from .kv_pool import KVPool
from .sampling import Sampled
from .sequence import Sequence
from .session import Session, SessionStore


class Scheduler:
    """Owns the waiting queue and the running set; plans steps and applies their results."""

    def __init__(self, config: EngineConfig, pool: KVPool, sessions: SessionStore, eos_ids: frozenset[int]) -> None:
        self.config, self.pool, self.sessions, self.eos_ids = config, pool, sessions, eos_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.preemptions = 0
        self.evictions = 0
        self.prefix_queries = self.prefix_hits = 0  # prompt tokens admitted, and of those found in the KV
        self._retired: list[Sequence] = []
        self._in_flight: set[str] = set()  # the requests of the step being run, between schedule and postprocess

    def check_room(self, n: int = 1) -> None:
        if len(self.waiting) + n > self.config.max_queued:
            raise Overloaded(
                f"server is full: {len(self.running)} running and {len(self.waiting)} waiting requests",
                retry_after_s=self.config.retry_after_s,
            )

    def add(self, req: Sequence) -> None:
        self.check_room()
        req.session.busy = req
        self.waiting.append(req)
        self.by_id[req.id] = req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepBatch:
        self._reap()
        tokens_left = self.config.max_batch_tokens
        planned = 0  # unreserved blocks this step takes from the pool
        chunks: list[Chunk] = []
        decodes = [r for r in self.running if len(r.session.pending) == 1]
        prefills = [r for r in self.running if len(r.session.pending) > 1]
        for req in decodes + prefills:
            if tokens_left == 0:
                break
            if req not in self.running:  # preempted while planning an older request
                continue
            n = min(len(req.session.pending), tokens_left)
            need = req.session.cache.pool_demand(n)
            fits, planned = self._make_room(req, need, planned, protect={c.request_id for c in chunks})
            if fits:
                chunks.append(self._chunk(req, n))
                tokens_left -= n
        for req in list(self.waiting):
            if tokens_left == 0 or len(self.running) >= self.config.max_running:
                break
            if req.parent is not None and not _prefilled(req.parent):
                continue  # a choice of an n > 1 request forks its parent's prompt once that is in the cache
            if req.fetch is not None and not req.fetch.done():
                continue  # its KV is being read back from disk, off the step loop
            admitted = self._admit(req, tokens_left, planned, protect={c.request_id for c in chunks})
            if admitted is None:
                break  # first come, first served: nobody overtakes a request that does not fit
            n, planned = admitted
            chunks.append(self._chunk(req, n))
            tokens_left -= n
        rows = tuple(self.by_id[c.request_id].sample_row() for c in chunks if c.sample)
        self._in_flight = {c.request_id for c in chunks}
        return StepBatch(tuple(chunks), rows)

    def _admit(self, req: Sequence, tokens_left: int, planned: int, protect: set[str]) -> tuple[int, int] | None:
        """Install the request's cache (reusing what the pool holds) and plan its first chunk -> (tokens, planned)."""
        session = req.session
        created = session.cache is None
        if created:
            if session.sizing is Sizing.STATIC:  # it reserves its whole capacity when installed
                fits, _ = self._make_room(req, self.pool.blocks_for(session.capacity), planned, protect, preempt=False)
                if not fits:
                    return None
            fetched = _fetched(req)
            try:
                self.pool.ensure(session, reuse=req.parent.session if req.parent is not None else None, fetched=fetched)
            except PoolExhausted:
                return None
        n = min(len(session.pending), tokens_left)
        fits, planned = self._make_room(req, session.cache.pool_demand(n), planned, protect, preempt=False)
        if not fits:
            if created:
                self.pool.drop(session)  # its shared blocks go back to the cache as they were
            return None
        self.waiting.remove(req)
        self.running.append(req)
        if req.admitted_at is None:
            req.admitted(session.cached_length)
            self.prefix_queries += req.prompt_tokens
            self.prefix_hits += req.cached_tokens
        return n, planned

    def _chunk(self, req: Sequence, n: int) -> Chunk:
        s = req.session
        pending = s.pending
        return Chunk(req.id, s.id, s.cache, tuple(pending[:n]), s.cached_length, sample=n == len(pending) and req.wants_tokens)

    def evict_idle(self, need: int, planned: int = 0, keep: Session | None = None) -> bool:
        """Drop idle sessions' KV, least recently used first, until `need` more blocks are free -> whether they are."""
        while self.pool.blocks.available() - planned < need:
            idle = [s for s in self.sessions.resident_idle() if s is not keep]
            if not idle:
                return False
            self.pool.drop(idle[0])
            self.evictions += 1
        return True

    def _make_room(self, req: Sequence, need: int, planned: int, protect: set[str], preempt: bool = True):
        """Evict idle sessions, then (if allowed) preempt younger requests, until `need` more blocks are free."""
        while not self.evict_idle(need, planned, keep=req.session):
            victims = [r for r in self.running if r is not req and r.id not in protect and r.session.cache is not None]
            if not preempt or not victims:
                return False, planned
            self._preempt(victims[-1])
        return True, planned + need

    def _preempt(self, req: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the history, requeue at the front."""
        self.running.remove(req)
        self.pool.drop(req.session)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _reap(self) -> None:
        for req in [r for r in (*self.waiting, *self.running) if r.cancelled]:
            req.finish("cancelled")
            self.retire(req)

    def stop(self, req: Sequence, kept: int) -> None:
        """The one way a stop string ends a request: its output stream found one after `kept` tokens.

        A request in the step being run ends once that step has written its KV (in postprocess); any
        other, waiting, running or already ended, ends here, now."""
        if req.id in self._in_flight:
            req.stop_at = kept
            return
        req.end_at(kept)
        if req.id in self.by_id:
            self.retire(req)
        else:
            self.pool.persist(req.session)  # an ended request's trimmed history

    def retire(self, req: Sequence) -> None:
        """Take a finished request out and release (or remove) its session."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.by_id.pop(req.id, None)
        self._retired.append(req)
        session = req.session
        session.busy = None
        session.last_used = time.monotonic()
        self.pool.persist(session)  # the turn is over: its record goes to disk (if there is a tier)
        if not session.persistent:
            self.pool.drop(session)
            self.sessions.remove(session)

    def postprocess(self, batch: StepBatch, sampled: list[Sampled]) -> None:
        """Apply one step's sampled tokens (one per sampling chunk, in order)."""
        self._in_flight = set()
        it = iter(sampled)
        for chunk in batch.chunks:
            req = self.by_id.get(chunk.request_id)
            token = next(it) if chunk.sample else None
            if req is None:
                continue
            assert req.session.cached_length == chunk.start + len(chunk.tokens)
            req.session.cache.publish(req.session.tokens, durable=req.session.persistent)  # full blocks become reusable prefixes
            if req.stop_at is not None:
                req.end_at(req.stop_at)
            elif req.cancelled:
                req.finish("cancelled")
            elif token is not None:
                req.accept(token, self.eos_ids)
            elif not req.wants_tokens and not req.session.pending:
                req.finish("length")  # a prefill-only request (max_tokens 0) is done
            if req.finished is not None:
                self.retire(req)

    def fail_step(self, batch: StepBatch, error: Exception) -> None:
        """A step raised: fail its requests and give their sessions back the history they had before."""
        self._in_flight = set()
        for chunk in batch.chunks:
            req = self.by_id.get(chunk.request_id)
            if req is None:
                continue
            # the failed request leaves the session as it found it: its history, and KV for a prefix of it
            req.session.restore(req.history_before, min(chunk.start, req.kept))
            req.finish("error", StepFailed(f"the model step failed: {type(error).__name__}: {error}"))
            self.retire(req)

    def take_retired(self) -> list[Sequence]:
        """Requests retired since the last call (for metrics)."""
        done, self._retired = self._retired, []
        return done

    def take_preemptions(self) -> int:
        n, self.preemptions = self.preemptions, 0
        return n

    def take_evictions(self) -> int:
        n, self.evictions = self.evictions, 0
        return n

    def take_prefix_counts(self) -> tuple[int, int]:
        """Prompt tokens admitted and, of those, reused from the KV, since the last call."""
        counts = self.prefix_queries, self.prefix_hits
        self.prefix_queries = self.prefix_hits = 0
        return counts


def _fetched(req: Sequence) -> dict | None:
    """The blocks read back from disk for the request, once (a failed read means recompute)."""
    fetch, req.fetch = req.fetch, None
    if fetch is None or fetch.exception() is not None:
        return None
    return fetch.result()


def _prefilled(parent: Sequence) -> bool:
    """Whether a parent's prompt (all but its last token) is in its cache, or the parent has gone."""
    s = parent.session
    return parent.finished is not None or (parent.admitted_at is not None and s.cached_length >= len(parent.prompt_ids) - 1)
