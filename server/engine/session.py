"""Sessions: token histories whose KV stays resident between requests, and their store."""
from __future__ import annotations

import hashlib
import math
import re
import secrets
import time
from dataclasses import dataclass, field

from kvcache import SessionCache, Sizing

from ..errors import Conflict, InvalidRequest, NotFound, Overloaded, quoted


@dataclass(frozen=True)
class Turn:
    """A request's prompt laid against a session's history: keep its first `kept` tokens, then add `new`."""

    kept: int
    new: tuple[int, ...]
    prompt_tokens: int  # the request's prompt, as its client counts it

    @property
    def length(self) -> int:
        """The history's length once the turn is taken."""
        return self.kept + len(self.new)


@dataclass(eq=False)
class Session:
    """One conversation: its full token history and, while resident, the cache holding its KV."""

    id: str
    capacity: int
    sizing: Sizing
    persistent: bool
    owner: str | None = None  # owner_id of the API key that made it (a hash: records on disk hold no keys)
    tokens: list[int] = field(default_factory=list)
    cache: SessionCache | None = None  # None: evicted or never run; rebuilt by prefill
    busy: object | None = None  # the Sequence running on it, if any
    last_used: float = field(default_factory=time.monotonic)  # renewed by each use; starts its idle TTL
    ttl: float | None = None  # seconds it may stay idle in RAM (persistent sessions)
    disk_ttl: float = 0.0  # seconds its disk copy stays after that
    salt: str | None = None  # a client's cache_salt: its prefix cache namespace within its owner's (see prefix_salt)
    # What a route keeps with the conversation (a stored response's object and items), JSON-safe; replaced,
    # never mutated, since a record written behind may still hold the old one
    meta: dict | None = None

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def expires_in(self, now: float) -> float:
        """Seconds until its idle TTL ends (never while a request runs on it)."""
        return float("inf") if self.ttl is None or self.busy is not None else self.last_used + self.ttl - now

    @property
    def used_at(self) -> float:
        """Wall-clock time of its last use."""
        return time.time() + self.last_used - time.monotonic()

    @property
    def expires_at(self) -> float | None:
        """Wall-clock time at which it leaves RAM unless used again."""
        return None if self.ttl is None else self.used_at + self.ttl

    @property
    def disk_expires_at(self) -> float | None:
        """Wall-clock time at which its disk copy goes, once its idle TTL and then its disk TTL have passed."""
        return None if self.ttl is None else self.used_at + self.ttl + self.disk_ttl

    @property
    def key(self) -> str:
        """Its name in the store, the cache registry and the disk tier: the id within its owner's namespace."""
        return session_key(self.id, self.owner)

    @property
    def cached_length(self) -> int:
        return self.cache.length if self.cache is not None else 0

    @property
    def pending(self) -> list[int]:
        """Tokens of the history whose KV is not in the cache yet."""
        return self.tokens[self.cached_length :]

    def resend(self, prompt: list[int]) -> Turn:
        """The whole conversation again (OpenAI clients): keep the longest common prefix, add the rest."""
        kept = common_prefix(self.tokens, prompt)
        return Turn(kept, tuple(prompt[kept:]), len(prompt))

    def continue_with(self, tokens: list[int]) -> Turn:
        """These tokens after the whole history."""
        return Turn(len(self.tokens), tuple(tokens), len(tokens))

    def take(self, turn: Turn, generates: bool) -> None:
        """Make the turn the history. A reply needs the logits after the last token, so when that token's KV
        is already cached it is rewound, and prefilled again as the one pending token."""
        self.truncate(turn.kept)
        self.tokens.extend(turn.new)
        if generates and not self.pending and self.cache is not None:
            self.cache.rewind(1)

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens of the history (and of the cache)."""
        del self.tokens[length:]
        self.truncate_cache(length)

    def truncate_cache(self, length: int) -> None:
        """Keep at most `length` tokens of KV; the history beyond them is prefilled again when needed."""
        if self.cache is not None and self.cache.length > length:
            self.cache.rewind(self.cache.length - length)

    def restore(self, tokens: list[int], valid: int) -> None:
        """Put back an earlier history of which only the first `valid` tokens can match the cache."""
        self.tokens[:] = tokens
        self.truncate_cache(valid)

    def owned_by(self, key: str | None) -> bool:
        return self.owner == owner_id(key)

    def record(self) -> dict:
        """What the disk tier keeps of a persistent session (its KV blocks are kept by content)."""
        expires = self.disk_expires_at
        return {"id": self.id, "key": self.key, "salt": self.salt, "tokens": list(self.tokens), "capacity": self.capacity, "sizing": self.sizing.value,
                "owner": self.owner, "used_at": round(self.used_at, 3),
                "expires": round(expires, 3) if expires is not None else None, "meta": self.meta}

    def info(self) -> dict:
        expires = self.expires_at
        return {
            "id": self.id,
            "length": len(self.tokens),
            "cached_length": self.cached_length,
            "capacity": self.capacity,
            "sizing": self.sizing.value,
            "bytes": self.cache.nbytes if self.cache is not None else 0,
            "resident": self.cache is not None,
            "busy": self.busy is not None,
            "expires_at": round(expires, 3) if expires is not None else None,
        }


def owner_id(principal: str | None) -> str | None:
    """Who owns a session, as records and metrics may show it: a hash, never the key."""
    return None if principal is None else hashlib.sha256(principal.encode()).hexdigest()


def session_key(session_id: str, owner: str | None) -> str:
    """A session id within its owner's namespace (owner: an owner id): two tenants may use the same id for
    two sessions, and no answer depends on which ids another tenant holds. '.' is in no id."""
    return session_id if owner is None else f"{owner[:32]}.{session_id}"


def principal(key: str | None, tenant: str | None = None) -> str | None:
    """The identity a request acts as: its API key, or a tenant a trusted gateway names under its key."""
    return key if tenant is None else f"{key or ''}\n{tenant}"


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two histories share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# at least as long as our own 18-byte ids, so a chosen id is no easier to guess
_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{22,128}")


class SessionStore:
    """Persistent and temporary sessions by id within their owner's namespace; generated ids are unguessable."""

    def __init__(self, max_sessions: int, per_owner: int | None = None, ttl: float | None = None,
                 disk_ttl: float = 0.0) -> None:
        self._sessions: dict[str, Session] = {}
        self.max_sessions, self.ttl, self.disk_ttl = max_sessions, ttl, disk_ttl
        self.per_owner = per_owner or max_sessions

    def create(self, capacity: int, sizing: Sizing, persistent: bool, owner: str | None, session_id: str | None = None,
               salt: str | None = None) -> Session:
        """A new session; `session_id` lets a client behind a hashing load balancer pick the id it routes on."""
        if persistent:
            self.check_quota(owner_id(owner))
        if session_id is not None:
            if not _CLIENT_ID.fullmatch(session_id):
                raise InvalidRequest("a client-chosen session id must be 22 to 128 characters of A-Z a-z 0-9 _ -", param="id")
            if session_key(session_id, owner_id(owner)) in self._sessions:
                raise Conflict(f"session {quoted(session_id)} already exists", param="id")
        return self._add(Session(session_id or secrets.token_urlsafe(18), capacity, sizing, persistent, owner_id(owner),
                                 salt=salt))

    def check_quota(self, owner: str | None) -> None:
        """Room for one more persistent session of this owner (an owner id), or a 429 that says when one frees."""
        persistent = [s for s in self._sessions.values() if s.persistent]
        mine = [s for s in persistent if s.owner == owner]
        if len(mine) >= self.per_owner and self.per_owner < self.max_sessions:
            raise Overloaded(f"this key holds its limit of {self.per_owner} sessions (--max-sessions-per-key); delete "
                             "some, or wait for an idle one to expire", retry_after_s=self._retry_after(mine))
        if len(persistent) >= self.max_sessions:
            raise Overloaded(f"the server holds its maximum of {self.max_sessions} sessions; delete some, or wait for "
                             "an idle one to expire", retry_after_s=self._retry_after(persistent))

    def _retry_after(self, sessions: list[Session]) -> int:
        """Seconds until the first of these sessions expires (a request running on one renews it)."""
        now = time.monotonic()
        soonest = min((s.expires_in(now) for s in sessions), default=float("inf"))
        return max(1, math.ceil(min(soonest, self.ttl or 1)))

    def _add(self, session: Session) -> Session:
        if session.persistent:
            session.ttl, session.disk_ttl = self.ttl, self.disk_ttl
        self._sessions[session.key] = session
        return session

    def expired(self, now: float) -> list[Session]:
        """Idle persistent sessions past their TTL."""
        return [s for s in self._sessions.values() if s.persistent and s.expires_in(now) <= 0]

    def restore(self, record: dict) -> Session:
        """A persistent session from its disk record: its history, with no KV resident yet."""
        session = Session(record["id"], int(record["capacity"]), Sizing(record["sizing"]), True, record.get("owner"),
                          tokens=[int(t) for t in record["tokens"]], salt=record.get("salt"),
                          meta=record["meta"] if isinstance(record.get("meta"), dict) else None)
        used_at = record.get("used_at")
        if used_at is not None:  # its idle TTL goes on from its last use, not from the restart
            session.last_used = time.monotonic() - max(0.0, time.time() - used_at)
        return self._add(session)

    def get(self, session_id: str, owner: str | None) -> Session:
        session = self._sessions.get(session_key(session_id, owner_id(owner)))
        if session is None or not session.persistent:
            raise NotFound(f"no session {quoted(session_id)}", param="session_id")
        return session

    def remove(self, session: Session) -> None:
        self._sessions.pop(session.key, None)

    def rewind(self, session: Session, length: int) -> None:
        """Keep the first `length` tokens of an idle session's history."""
        self.check_idle(session)
        if not 0 <= length <= len(session.tokens):
            raise InvalidRequest(f"length must be between 0 and the session's length {len(session.tokens)}", param="length")
        session.truncate(length)

    def check_idle(self, session: Session) -> None:
        if session.busy is not None:
            raise Conflict(f"session {quoted(session.id)} is busy with another request", param="session_id")

    def resident_idle(self) -> list[Session]:
        """Idle sessions holding a cache, least recently used first (eviction order)."""
        idle = [s for s in self._sessions.values() if s.cache is not None and s.busy is None]
        return sorted(idle, key=lambda s: s.last_used)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

