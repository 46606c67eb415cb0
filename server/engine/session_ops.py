"""The engine's session half: persistent sessions by id, and what routes do to them (create, fork,
rewind, snapshot, delete), each under the engine's lock; and the task that expires idle ones.

A mixin of `Engine` (server/engine/engine.py), which owns the attributes used here: `lock`, `config`,
`sessions`, `pool`, `scheduler`, `lifetimes`, `metrics`, `accepting`, `max_context`, `default_capacity`.
"""
from __future__ import annotations

import asyncio
import logging
import time

from kvcache import PoolExhausted, Sizing

from ..errors import Conflict, InvalidRequest, NotFound, Overloaded, ShuttingDown, quoted
from .session import Session, owner_id, session_key

log = logging.getLogger("kvserve.engine")


class SessionOps:
    """Session routes' operations on the engine."""

    def session(self, session_id: str, owner: str | None) -> Session:
        """A persistent session by id (the caller holds the lock), its TTL renewed: one in RAM, or one on the
        --kv-disk (moved there idle, or left by a server beside this one), brought back."""
        try:
            session = self.sessions.get(session_id, owner)
        except NotFound:
            session = self.lifetimes.take_over(session_id, owner)
            if session is None:
                raise
        session.touch()
        return session

    async def _sweep_loop(self) -> None:
        """Idle sessions past their TTL leave RAM (server/engine/lifetimes.py)."""
        while True:
            await asyncio.sleep(min(1.0, self.config.session_ttl / 4))
            try:
                with self.lock:
                    if self.lifetimes.expire(time.monotonic()):
                        self._update_gauges()
            except Exception:  # a bug here must not stop expiry for good, nor serving
                log.exception("session expiry")

    def snapshot(self, session: Session) -> bool:
        """Write the session's record and every block handed over so far -> whether its record is on disk
        (not while the disk is full, nor if its own file fails)."""
        if self.pool.tier is None:
            raise InvalidRequest("this server has no disk tier; start it with --kv-disk DIR")
        with self.lock:
            self.sessions.check_idle(session)
            saved = self.pool.persist(session)
        return self.pool.tier.flush(timeout=60) and saved is not None and saved.done() and saved.result()

    def create_session(self, capacity: int | None, sizing: str | None, owner: str | None, persistent: bool = True,
                       session_id: str | None = None) -> Session:
        if not self.accepting:
            raise ShuttingDown("server is shutting down")
        capacity = self.default_capacity if capacity is None else capacity
        if capacity > self.max_context:
            raise InvalidRequest(f"capacity {capacity} exceeds the context of {self.max_context} tokens", param="capacity")
        sizing = Sizing(sizing) if sizing is not None else self.config.session_sizing
        if sizing is Sizing.STATIC and self.pool.full_bytes(capacity) > self.pool.budget:
            raise InvalidRequest(f"a static session of {capacity} tokens needs {self.pool.full_bytes(capacity)} bytes, "
                                 f"more than the whole KV budget of {self.pool.budget} bytes", param="capacity")
        with self.lock:
            tier = self.pool.tier
            if (persistent and session_id is not None and tier is not None
                    and tier.find_session(session_key(session_id, owner_id(owner))) is not None):
                raise Conflict(f"session {quoted(session_id)} already exists", param="id")
            session = self._new_session(capacity, sizing, persistent, owner, session_id)
            if sizing is Sizing.STATIC:  # it holds back its whole capacity from the start
                if not self.scheduler.evict(self.pool.blocks_for(capacity), keep=session):
                    self.sessions.remove(session)
                    raise Overloaded(f"the KV pool cannot hold back {capacity} tokens for a static session now",
                                     retry_after_s=self.config.retry_after_s)
                self.pool.ensure(session)
            self.pool.persist(session)
            self._update_gauges()
        return session

    def _new_session(self, capacity: int, sizing: Sizing, persistent: bool, owner: str | None,
                     session_id: str | None, salt: str | None = None) -> Session:
        try:
            return self.sessions.create(capacity, sizing, persistent, owner, session_id, salt)
        except Overloaded:
            self.scheduler.tenants[owner_id(owner)].rejected += 1
            raise

    def delete_session(self, session: Session) -> None:
        with self.lock:
            self.sessions.check_idle(session)
            self.pool.drop(session)
            self.pool.forget(session)
            self.sessions.remove(session)
            self._update_gauges()

    def fork_session(self, parent: Session, owner: str | None, session_id: str | None = None) -> Session:
        """A new session with the parent's history, sharing its KV blocks until either side writes."""
        if not self.accepting:
            raise ShuttingDown("server is shutting down")
        with self.lock:
            self.sessions.check_idle(parent)
            child = self._new_session(parent.capacity, parent.sizing, True, owner, session_id, parent.salt)
            child.tokens = list(parent.tokens)
            if parent.cache is not None:
                try:
                    self.pool.fork(parent, child)
                except PoolExhausted as e:
                    self.sessions.remove(child)
                    raise Overloaded(f"no KV room to fork a static session: {e}", retry_after_s=self.config.retry_after_s) from None
            self.pool.persist(child)
            self._update_gauges()
        return child

    def rewind_session(self, session: Session, length: int) -> None:
        with self.lock:
            self.sessions.rewind(session, length)
            self.pool.persist(session)
