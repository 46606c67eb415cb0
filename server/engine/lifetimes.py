"""Where persistent sessions live over time: in RAM while in use; on the disk tier (--kv-disk) once idle
past --session-ttl, or gone if there is none; gone from disk too once --session-disk-ttl has passed
after that. A session on disk comes back into RAM when a request names it, on this server or on any
other that shares the folder. At start, the sessions a server before this one left are read back, or,
for one of several servers on the folder (--peers), left there until a request names one: a replica
that took them all would hold sessions the front door sends to the others."""
from __future__ import annotations

import logging
import time

from ..errors import HeldElsewhere, Overloaded, quoted
from .kv_pool import KVPool
from .session import Session, SessionStore, owner_id, session_key

log = logging.getLogger("kvserve.engine")


class Lifetimes:
    """Moves idle sessions out of RAM and brings them back; the caller holds the engine's lock."""

    def __init__(self, sessions: SessionStore, pool: KVPool, max_context: int, vocab: int) -> None:
        self.sessions, self.pool, self.max_context, self.vocab = sessions, pool, max_context, vocab
        self.parked: dict[str, float] = {}  # key -> when its disk copy expires: the sessions this server moved there

    def restore(self, on_request: bool = False) -> None:
        """At start: the sessions on disk that fit; one idle past its TTL (or past its owner's quota), or every
        one if `on_request`, stays on disk until a request names it, and one past its disk TTL goes."""
        tier, now = self.pool.tier, time.time()
        counts = {"restored": 0, "left on disk": 0, "expired": 0, "held by another server": 0}
        for record in tier.sessions():
            if not self._fits(record):
                continue
            key = record["key"]
            if _gone(record, now):
                if tier.claim(key):
                    tier.delete_session(key)
                    counts["expired"] += 1
                continue
            if on_request or self._idle_on_disk(record, now):
                self.parked[key] = _expiry(record)
                counts["left on disk"] += 1
            elif tier.claim(key):
                self.sessions.restore(record)
                counts["restored"] += 1
            else:  # another live server on the folder has it; it may come here once that one dies
                counts["held by another server"] += 1
        log.info("kv disk %s: %s", tier.root, ", ".join(f"{n} sessions {what}" for what, n in counts.items()))

    def _idle_on_disk(self, record: dict, now: float) -> bool:
        used_at, ttl = record.get("used_at"), self.sessions.ttl
        if used_at is not None and ttl is not None and used_at + ttl <= now:
            return True
        try:
            self.sessions.check_quota(record.get("owner"))
        except Overloaded:
            return True
        return False

    def _fits(self, record: dict) -> bool:
        if record["key"] != session_key(record["id"], record.get("owner")):
            log.warning("kv disk: session record %s is not filed under its owner's namespace (written before "
                        "ids were scoped to tenants); skipped", record["key"])
            return False
        if record["capacity"] > self.max_context or any(t >= self.vocab for t in record["tokens"]):
            log.warning("kv disk: session %s does not fit this server; skipped", record["key"])
            return False
        return True

    def take_over(self, session_id: str, owner: str | None) -> Session | None:
        """A session on disk, this server's or one another server left on the shared folder, brought into
        RAM once no live server holds it -> None if there is none for this owner."""
        tier, key = self.pool.tier, session_key(session_id, owner_id(owner))
        record = tier.find_session(key) if tier is not None else None
        if record is None or record.get("owner") != owner_id(owner) or _gone(record, time.time()) or not self._fits(record):
            return None
        self.sessions.check_quota(record.get("owner"))
        if not tier.claim(key):
            raise HeldElsewhere(f"session {quoted(session_id)} is held by another server on this --kv-disk; "
                                "send its requests there, or retry once that server is gone", tier.holder_of(key),
                                param="session_id")
        self.parked.pop(key, None)
        return self.sessions.restore(record)

    def expire(self, now: float) -> int:
        """Move idle sessions past their TTL out of RAM, and delete disk copies past theirs -> sessions moved."""
        tier = self.pool.tier
        expired = self.sessions.expired(now)
        if tier is not None and tier.healthy and tier.writes_paused:
            # a full disk: their records may lag their histories, so they stay in RAM (their KV goes) until it has room
            for session in expired:
                self.pool.drop(session)
            expired = []
        for session in expired:
            self.pool.drop(session)  # its full blocks stay cached for a prefix hit, until the pool needs them
            if tier is not None and tier.healthy:
                self.pool.persist(session)  # its last record, saying when the disk copy goes
                tier.release(session.key)  # once that is written: any server on the folder may take it up
                self.parked[session.key] = session.disk_expires_at
            else:
                self.pool.forget(session)
            self.sessions.remove(session)
        wall = time.time()
        for key, when in list(self.parked.items()):
            if when > wall:
                continue
            del self.parked[key]
            record = tier.find_session(key)
            if record is not None and not _gone(record, wall):
                self.parked[key] = _expiry(record)  # another server used it since: its later expiry
            elif record is not None and tier.claim(key):  # unless a live server holds it now
                tier.delete_session(key)
        return len(expired)


def _expiry(record: dict) -> float:
    """When a record's disk copy goes (never, for one written before sessions expired)."""
    return float("inf") if record.get("expires") is None else record["expires"]


def _gone(record: dict, now: float) -> bool:
    return _expiry(record) <= now
