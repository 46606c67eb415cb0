"""Off-graph KV caches behind the functional kvcache::update_and_attend op."""
from .block_pool import BlockPool
from .config import CacheConfig, Sizing
from .errors import CacheError, CacheFull, NoActiveCache, PoolExhausted, PositionMismatch, UnknownCache
from .op import update_and_attend
from .registry import REGISTRY, CacheRegistry
from .session_cache import SessionCache

__all__ = [
    "REGISTRY",
    "BlockPool",
    "CacheConfig",
    "CacheError",
    "CacheFull",
    "CacheRegistry",
    "NoActiveCache",
    "PoolExhausted",
    "PositionMismatch",
    "SessionCache",
    "Sizing",
    "UnknownCache",
    "update_and_attend",
]
