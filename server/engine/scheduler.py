"""Continuous batching: which requests run in the next step, within token, session and KV budgets.

Each step first gives every running decode its one token (and, in the rows a step has spare below
max_rows, its drafts: drafts.py), so streams keep pace however many prompts wait; the rest of the token
budget goes to prefill chunks, of running requests (oldest first) and then
of waiting ones as they are admitted. Waiting requests are admitted fairly between tenants: the one
whose tenant has been served the fewest (weighted) tokens goes first, by priority and then arrival
within a tenant (server/engine/tenants.py), up to each tenant's share of the running slots. An
admitted request's session starts from the longest cached prefix of its history (or from its parent's
KV, for the choices of one `n` > 1 request), so only the rest is prefilled; one that scores its prompt
(echo with logprobs) or embeds it prefills it whole, since only a row run gives logits or hidden states. An
embedding request samples nothing: its chunks return their rows' final hidden states, which it pools
until its prompt is done. KV blocks come from the
pool's free and cached blocks, then from evicting idle sessions (least recently used first), then
the KV of sessions whose request waits (the last in the queue first) and, failing that, from
preempting the youngest running request; dropped KV is recomputed when it is next needed.
A request past its deadline ends as a cancel would: with its tokens so far, or, if it never ran, with
a timeout error that leaves its session as it was.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Future

from kvcache import PoolExhausted, Sizing

from ..config import EngineConfig
from ..errors import Overloaded, StepFailed, TimedOut
from .batch import Chunk, StepBatch
from .drafts import RowCosts
from .kv_pool import KVPool
from .metrics import StepCounts
from .sampling import Sampled
from .sequence import Sequence
from .session import Session, SessionStore
from .tenants import Tenants


class Scheduler:
    """Owns the waiting queue and the running set; plans steps and applies their results."""

    def __init__(self, config: EngineConfig, pool: KVPool, sessions: SessionStore, eos_ids: frozenset[int],
                 label_secret: bytes | None = None) -> None:
        assert config.max_batch_tokens is not None, "EngineConfig.for_model fills in the step's tokens"
        self.config, self.pool, self.sessions, self.eos_ids = config, pool, sessions, eos_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.by_id: dict[str, Sequence] = {}
        self.counts = StepCounts()  # what the steps did since the metrics last took them
        self._retired: list[Sequence] = []
        # requests' event queues -> their session's record being written: their Finished waits for it (engine.py)
        self.saving: dict[asyncio.Queue, Future] = {}
        self._in_flight: set[str] = set()  # the requests of the step being run, between schedule and postprocess
        self.tenants = Tenants(config.tenant_weights, label_secret)
        self.row_costs = RowCosts(config.speculation.max_rows)  # what drafts cost, as steps are timed

    def check_room(self, owner: str | None, n: int = 1) -> None:
        """Refuse (429) only what does not fit: running slots free count as room, as the queue does."""
        c = self.config
        mine = sum(r.session.owner == owner for r in (*self.waiting, *self.running))
        running, queued = c.per_key("max_running"), c.per_key("max_queued")
        if len(self.waiting) + len(self.running) + n > c.max_running + c.max_queued:
            self.tenants[owner].rejected += n
            raise Overloaded(f"server is full: {len(self.running)} running and {len(self.waiting)} waiting requests",
                             retry_after_s=c.retry_after_s)
        if mine + n > running + queued:
            self.tenants[owner].rejected += n
            raise Overloaded(f"this key has {mine} requests running or queued, its limit of {running} running and "
                             f"{queued} queued (--max-running-per-key, --max-queued-per-key)", retry_after_s=c.retry_after_s)

    def add(self, req: Sequence) -> None:
        owner = req.session.owner
        self.check_room(owner)
        busy = self.busy_tenants()
        if owner not in busy:
            self.tenants.wake(owner, busy)
        req.session.busy = req
        self.waiting.append(req)
        self.by_id[req.id] = req

    def busy_tenants(self) -> set[str | None]:
        return {r.session.owner for r in (*self.waiting, *self.running)}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> StepBatch:
        self._reap()
        tokens_left = self.config.max_batch_tokens
        planned = 0  # unreserved blocks this step takes from the pool
        chunks: list[Chunk] = []
        decodes = [r for r in self.running if len(r.session.pending) == 1]
        prefills = [r for r in self.running if len(r.session.pending) > 1]
        spare = max(0, self.config.speculation.max_rows - len(decodes))  # rows drafts may add: few while few decode
        row_cost = self.row_costs.row_cost() if spare else None
        # Prefill beside decodes lengthens the step every decoding stream waits on: it may have a smaller share.
        prefill_left = (self.config.mixed_prefill_tokens if decodes else None) or tokens_left
        for req in decodes + prefills:
            if tokens_left == 0:
                break
            if req not in self.running:  # preempted while planning an older request
                continue
            decoding = len(req.session.pending) == 1
            n = min(len(req.session.pending), tokens_left if decoding else min(tokens_left, prefill_left))
            if n == 0:
                break  # the prefill share is spent, and only prefills are left
            drafts = req.draft(min(spare, tokens_left - n), row_cost) if decoding and spare else ()
            need = req.session.cache.pool_demand(n + len(drafts))
            fits, planned = self._make_room(req, need, planned, protect={c.request_id for c in chunks})
            if fits:
                chunks.append(self._chunk(req, n, drafts))
                self.tenants.charge(req.session.owner, n)
                tokens_left -= n + len(drafts)
                if not decoding:
                    prefill_left -= n
                spare -= len(drafts)
        while min(tokens_left, prefill_left) > 0 and len(self.running) < self.config.max_running:
            req = self._next_fair()
            if req is None:
                break
            admitted = self._admit(req, min(tokens_left, prefill_left), planned, protect={c.request_id for c in chunks})
            if admitted is None:
                break  # nobody overtakes the fairest request while it does not fit: it would starve
            n, planned = admitted
            chunks.append(self._chunk(req, n))
            self.tenants.charge(req.session.owner, n)
            tokens_left -= n
            prefill_left -= n
        rows = tuple(r for c in chunks if c.sample for r in self.by_id[c.request_id].sample_rows(c.draft_tokens))
        self._in_flight = {c.request_id for c in chunks}
        return StepBatch(tuple(chunks), rows)

    def _next_fair(self) -> Sequence | None:
        """The waiting request to admit next: a preempted one first (it ran already), then the one whose
        tenant has the smallest counter, by priority and then arrival within the tenant."""
        limit = self.config.per_key("max_running")
        running: dict[str | None, int] = {}
        for r in self.running:
            running[r.session.owner] = running.get(r.session.owner, 0) + 1
        best, best_key = None, None
        for order, req in enumerate(self.waiting):
            owner = req.session.owner
            if running.get(owner, 0) >= limit:
                continue  # its tenant holds its share of the running slots
            if req.parent is not None and not _prefilled(req.parent):
                continue  # a choice of an n > 1 request forks its parent's prompt once that is in the cache
            if req.fetch is not None and not req.fetch.done():
                continue  # its KV is being read back from disk, off the step loop
            if req.admitted_at is not None:
                return req  # preempted: back at the front, in the order it was preempted
            key = (self.tenants[owner].counter, req.priority, order)
            if best_key is None or key < best_key:
                best, best_key = req, key
        return best

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
                self.pool.ensure(session, req.parent.session if req.parent is not None else None, fetched, req.reuse_limit)
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
            self.counts.prefix_queries += req.prompt_tokens
            self.counts.prefix_hits += req.cached_tokens
        return n, planned

    def _chunk(self, req: Sequence, n: int, drafts: tuple[int, ...] = ()) -> Chunk:
        s = req.session
        pending = s.pending
        return Chunk(req.id, s.id, s.cache, (*pending[:n], *drafts), s.cached_length, sample=n == len(pending) and req.wants_tokens,
                     scored=req.prompt_targets(s.cached_length, n), scored_top=req.params.prompt_logprobs or 0, drafts=len(drafts),
                     pooled=req.pooled_rows(s.cached_length, n))

    def evict(self, need: int, planned: int = 0, keep: Session | None = None) -> bool:
        """Drop the KV of sessions no step runs until `need` more blocks are free -> whether they are: idle
        sessions, least recently used first, then those whose request waits, the last in the queue first.
        A waiting request's KV pins blocks that no finishing request gives back: were it kept, requests
        waiting on each other's blocks with none running would wait forever. Its full blocks stay cached,
        and what is lost is prefilled again once it is admitted, as after a preemption."""
        while self.pool.blocks.available() - planned < need:
            idle = [s for s in self.sessions.resident_idle() if s is not keep] or [
                r.session for r in reversed(self.waiting) if r.session.cache is not None and r.session is not keep]
            if not idle:
                return False
            self.pool.drop(idle[0])
            self.counts.evictions += 1
        return True

    def _make_room(self, req: Sequence, need: int, planned: int, protect: set[str], preempt: bool = True):
        """Evict sessions no step runs, then (if allowed) preempt younger requests, until `need` more blocks are free."""
        while not self.evict(need, planned, keep=req.session):
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
        self.counts.preemptions += 1

    def _reap(self) -> None:
        now = time.monotonic()
        for req in [r for r in (*self.waiting, *self.running) if r.cancelled or r.past_deadline(now)]:
            if req.cancelled:
                req.finish(req.cancel_reason)
            elif req.admitted_at is not None:
                req.finish("timeout")  # it ran: it ends with its tokens so far, as a cancel would
            else:
                req.session.restore(req.history_before, min(req.session.cached_length, req.kept))
                req.finish("error", TimedOut(f"the request's deadline of {req.timeout:g} s passed while it waited "
                                             "for a running slot", param="timeout"))
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
        # the turn is over: its record goes to disk (if there is a tier), and its final event waits for that
        saved = self.pool.persist(session)
        if saved is not None:
            self.saving[req.events] = saved
        if not session.persistent:
            self.pool.drop(session)
            self.sessions.remove(session)

    def postprocess(self, batch: StepBatch, sampled: list[Sampled], scores: list[list[Sampled]] = (),
                    hidden: list = ()) -> None:
        """Apply one step's sampled tokens, prompt logprobs and embeddings' hidden rows (one per sampling,
        scored or pooling chunk, in order)."""
        self._in_flight = set()
        it, scored, pooled = iter(sampled), iter(scores), iter(hidden)
        for chunk in batch.chunks:
            req = self.by_id.get(chunk.request_id)
            tokens = [next(it) for _ in range(chunk.sampled_rows)]
            rows = next(scored) if chunk.scored else None
            states = next(pooled) if chunk.pooled else None
            if req is None:
                continue
            session = req.session
            assert session.cached_length == chunk.start + len(chunk.tokens)
            if rows is not None:
                req.scored(chunk.start, rows)  # before its first event, which tells the API they are there
            if states is not None:
                req.pool(chunk.start + len(chunk.tokens), states)
            if chunk.drafts:
                tokens = req.check_drafts(chunk.draft_tokens, tokens)
                self.counts.drafted(chunk.drafts, len(tokens) - 1)
            if req.stop_at is not None:
                req.end_at(req.stop_at)
            elif req.cancelled:
                req.finish(req.cancel_reason)
            elif tokens:
                self.counts.emitted += req.accept_all(tokens, self.eos_ids)
            elif not req.wants_tokens and not session.pending:
                req.finish("length")  # a prefill-only request (max_tokens 0, an embedding) is done
            session.truncate_cache(len(session.tokens))  # kept drafts past where the request ended
            session.cache.publish(session.tokens, durable=session.persistent)  # full blocks become reusable prefixes
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

    def take_counts(self) -> StepCounts:
        """What the steps counted since the last call (for metrics)."""
        counts, self.counts = self.counts, StepCounts()
        return counts


def _fetched(req: Sequence) -> dict | None:
    """The blocks read back from disk for the request, once (a failed read means recompute)."""
    fetch, req.fetch = req.fetch, None
    return None if fetch is None or fetch.exception() is not None else fetch.result()


def _prefilled(parent: Sequence) -> bool:
    """Whether a parent's prompt (all but its last token) is in its cache, or the parent has gone."""
    s = parent.session
    return parent.finished is not None or (parent.admitted_at is not None and s.cached_length >= len(parent.prompt_ids) - 1)
