"""Sessions: token histories whose KV stays resident between requests, and their store."""
from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass, field

from kvcache import SessionCache, Sizing

from ..errors import Conflict, InvalidRequest, NotFound, Overloaded


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
    last_used: float = field(default_factory=time.monotonic)

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
        return {"id": self.id, "tokens": list(self.tokens), "capacity": self.capacity, "sizing": self.sizing.value,
                "owner": self.owner, "expires": None}  # sessions live until deleted: no expiry yet

    def info(self) -> dict:
        return {
            "id": self.id,
            "length": len(self.tokens),
            "cached_length": self.cached_length,
            "capacity": self.capacity,
            "sizing": self.sizing.value,
            "bytes": self.cache.nbytes if self.cache is not None else 0,
            "resident": self.cache is not None,
            "busy": self.busy is not None,
        }


def owner_id(key: str | None) -> str | None:
    return None if key is None else hashlib.sha256(key.encode()).hexdigest()


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
    """Persistent and temporary sessions by id; ids are unguessable and scoped to their owner's key."""

    def __init__(self, max_sessions: int) -> None:
        self._sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions

    def create(self, capacity: int, sizing: Sizing, persistent: bool, owner: str | None, session_id: str | None = None) -> Session:
        """A new session; `session_id` lets a client behind a hashing load balancer pick the id it routes on."""
        if persistent and sum(s.persistent for s in self._sessions.values()) >= self.max_sessions:
            raise Overloaded(f"the server holds its maximum of {self.max_sessions} sessions; delete some first")
        if session_id is not None:
            if not _CLIENT_ID.fullmatch(session_id):
                raise InvalidRequest("a client-chosen session id must be 22 to 128 characters of A-Z a-z 0-9 _ -", param="id")
            if session_id in self._sessions:
                raise Conflict(f"session {session_id!r} already exists", param="id")
        session = Session(session_id or secrets.token_urlsafe(18), capacity, sizing, persistent, owner_id(owner))
        self._sessions[session.id] = session
        return session

    def restore(self, record: dict) -> Session:
        """A persistent session from its disk record: its history, with no KV resident yet."""
        session = Session(record["id"], int(record["capacity"]), Sizing(record["sizing"]), True, record.get("owner"),
                          tokens=[int(t) for t in record["tokens"]])
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str, owner: str | None) -> Session:
        session = self._sessions.get(session_id)
        # Another key's session is reported as missing, so ids cannot be probed across keys.
        if session is None or not session.persistent or not session.owned_by(owner):
            raise NotFound(f"no session {session_id!r}", param="session_id")
        return session

    def remove(self, session: Session) -> None:
        self._sessions.pop(session.id, None)

    def rewind(self, session: Session, length: int) -> None:
        """Keep the first `length` tokens of an idle session's history."""
        self.check_idle(session)
        if not 0 <= length <= len(session.tokens):
            raise InvalidRequest(f"length must be between 0 and the session's length {len(session.tokens)}", param="length")
        session.truncate(length)

    def check_idle(self, session: Session) -> None:
        if session.busy is not None:
            raise Conflict(f"session {session.id!r} is busy with another request", param="session_id")

    def resident_idle(self) -> list[Session]:
        """Idle sessions holding a cache, least recently used first (eviction order)."""
        idle = [s for s in self._sessions.values() if s.cache is not None and s.busy is None]
        return sorted(idle, key=lambda s: s.last_used)

    def __iter__(self):
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

