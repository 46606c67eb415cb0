"""Session caches in the registry, under one byte budget (static caches count their full capacity)."""
from __future__ import annotations

from kvcache import CacheConfig, CacheRegistry, SessionCache, Sizing
from kvcache.session_cache import grown_allocation

from .session import Session


class KVPool:
    """Installs, measures and drops session caches; the scheduler plans steps against `budget`."""

    def __init__(self, registry: CacheRegistry, budget: int, layout: CacheConfig) -> None:
        self.registry = registry
        self.budget = budget
        self.layout = layout  # n_layers, heads, dims and dtype; capacity and sizing come per session

    def config_for(self, session: Session) -> CacheConfig:
        l = self.layout
        return CacheConfig(l.n_layers, l.n_kv_heads, l.head_dim, session.capacity, l.v_head_dim, session.sizing, l.dtype)

    def used(self) -> int:
        return self.registry.total_bytes()

    def full_bytes(self, capacity: int) -> int:
        return self.layout.bytes_per_token() * capacity

    def growth(self, session: Session, n: int) -> int:
        """Bytes the pool grows by if `session` runs n more tokens (installing its cache if needed)."""
        if session.cache is None:
            alloc = session.capacity if session.sizing is Sizing.STATIC else grown_allocation(0, n, session.capacity)
            return self.layout.bytes_per_token() * alloc
        return session.cache.bytes_after(n) - session.cache.nbytes

    def ensure(self, session: Session) -> None:
        if session.cache is None:
            session.cache = self.registry.install(session.id, SessionCache(self.config_for(session)))

    def drop(self, session: Session) -> None:
        """Free a session's KV; its token history stays, so a later prefill rebuilds it."""
        if session.cache is not None:
            self.registry.uninstall(session.id)
            session.cache = None

