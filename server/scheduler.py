"""Continuous batching: which requests run in the next step, within token, session and KV budgets.

Requests are served first come, first served. Each step gives every running request (oldest first)
up to the rest of the token budget for its pending tokens -- one for a decode, a chunk for a prefill
-- then admits waiting requests while slots and budget last. KV memory comes from evicting idle
sessions (least recently used first) and, failing that, from preempting the youngest running
request, whose KV is dropped and recomputed later from its token history.
"""
from __future__ import annotations

import time
from collections import deque

from .batch import Chunk, StepBatch
from .config import EngineConfig
from .errors import Overloaded, StepFailed
from .kv_pool import KVPool
from .sampling import Sampled
from .sequence import Request
from .session import SessionStore


class Scheduler:
    """Owns the waiting queue and the running set; plans steps and applies their results."""

    def __init__(self, config: EngineConfig, pool: KVPool, sessions: SessionStore, eos_ids: frozenset[int]) -> None:
        self.config, self.pool, self.sessions, self.eos_ids = config, pool, sessions, eos_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.preemptions = 0
        self.evictions = 0
        self._retired: list[Request] = []

    def check_room(self) -> None:
        if len(self.waiting) >= self.config.max_queued:
            raise Overloaded(
                f"server is full: {len(self.running)} running and {len(self.waiting)} waiting requests",
                headers={"Retry-After": "1"},
            )

    def add(self, req: Request) -> None:
        self.check_room()
        req.session.busy = req
        self.waiting.append(req)
        self.by_id[req.id] = req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepBatch:
        self._reap()
        tokens_left = self.config.max_batch_tokens
        planned = 0  # bytes this step adds to the pool
        chunks: list[Chunk] = []
        for req in list(self.running):
            if tokens_left == 0:
                break
            if req not in self.running:  # preempted while planning an older request
                continue
            n = min(len(req.session.pending), tokens_left)
            if n == 0:
                continue
            fits, planned = self._make_room(req, n, planned, protect={c.request_id for c in chunks})
            if not fits:
                continue
            chunks.append(self._chunk(req, n))
            tokens_left -= n
        while self.waiting and tokens_left > 0 and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            n = min(len(req.session.pending), tokens_left)
            fits, planned = self._make_room(req, n, planned, protect={c.request_id for c in chunks}, preempt=False)
            if not fits:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(req)
            req.admitted_at = req.admitted_at or time.monotonic()
            self.pool.ensure(req.session)
            chunks.append(self._chunk(req, n))
            tokens_left -= n
        return StepBatch(tuple(chunks), inject_fault=any(self.by_id[c.request_id].inject_fault for c in chunks))

    def _chunk(self, req: Request, n: int) -> Chunk:
        s = req.session
        pending = s.pending
        return Chunk(req.id, s.id, tuple(pending[:n]), s.cached_length, sample=n == len(pending) and req.wants_tokens)

    def _make_room(self, req: Request, n: int, planned: int, protect: set[str], preempt: bool = True):
        need = self.pool.growth(req.session, n)
        while self.pool.used() + planned + need > self.pool.budget:
            idle = self.sessions.resident_idle()
            if idle:
                self.pool.drop(idle[0])
                self.evictions += 1
                continue
            victims = [r for r in self.running if r is not req and r.id not in protect and r.session.cache is not None]
            if not preempt or not victims:
                return False, planned
            self._preempt(victims[-1])
        return True, planned + need

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: drop the KV, keep the history, requeue at the front."""
        self.running.remove(req)
        self.pool.drop(req.session)
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _reap(self) -> None:
        for req in [r for r in (*self.waiting, *self.running) if r.cancelled]:
            req.finish("cancelled")
            self.retire(req)

    def retire(self, req: Request) -> None:
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
        if not session.persistent:
            self.pool.drop(session)
            self.sessions.remove(session)

    def postprocess(self, batch: StepBatch, sampled: list[Sampled]) -> None:
        """Apply one step's sampled tokens (one per sampling chunk, in order)."""
        it = iter(sampled)
        for chunk in batch.chunks:
            req = self.by_id.get(chunk.request_id)
            token = next(it) if chunk.sample else None
            if req is None:
                continue
            assert req.session.cached_length == chunk.start + len(chunk.tokens)
            if req.cancelled:
                req.finish("cancelled")
            elif token is not None:
                req.accept(token, self.eos_ids)
            elif not req.wants_tokens and not req.session.pending:
                req.finish("length")  # a prefill-only request (max_tokens 0) is done
            if req.finished is not None:
                self.retire(req)

    def fail_step(self, batch: StepBatch, error: Exception) -> None:
        """A step raised: fail its requests and give their sessions back the history they had before."""
        for chunk in batch.chunks:
            req = self.by_id.get(chunk.request_id)
            if req is None:
                continue
            # the failed request leaves the session as it found it: its history, and KV for a prefix of it
            req.session.restore(req.history_before, min(chunk.start, req.kept))
            req.finish("error", StepFailed(f"the model step failed: {type(error).__name__}: {error}"))
            self.retire(req)

    def take_retired(self) -> list[Request]:
        """Requests retired since the last call (for metrics)."""
        done, self._retired = self._retired, []
        return done

    def take_preemptions(self) -> int:
        n, self.preemptions = self.preemptions, 0
        return n

    def take_evictions(self) -> int:
        n, self.evictions = self.evictions, 0
        return n
