"""Typed errors raised by the cache layer; none of them leaves a cache changed."""
from __future__ import annotations


class CacheError(Exception):
    """Base class of every error raised by kvcache."""


class CacheFull(CacheError):
    """A step would write past a cache's hard capacity."""

    def __init__(self, key: str, length: int, requested: int, capacity: int) -> None:
        self.key, self.length, self.requested, self.capacity = key, length, requested, capacity
        super().__init__(
            f"cache {key!r} holds {length} tokens; adding {requested} would exceed its capacity of {capacity}"
        )


class PositionMismatch(CacheError):
    """A step declared positions that do not continue the session's history."""


class NoActiveCache(CacheError):
    """update_and_attend ran while no cache was active in the registry."""


class UnknownCache(CacheError):
    """A key names no installed cache."""


class PoolExhausted(CacheError):
    """The shared block pool has too few free or evictable blocks for a step or a reservation."""

    def __init__(self, needed: int, available: int) -> None:
        self.needed, self.available = needed, available
        super().__init__(f"the KV pool has {max(available, 0)} blocks to give, {needed} are needed")
