"""Off-graph KV caches behind the functional kvcache::update_and_attend op."""
from .config import CacheConfig, Sizing
from .errors import CacheError, CacheFull, NoActiveCache, PositionMismatch, UnknownCache
from .op import update_and_attend
from .registry import REGISTRY, CacheRegistry
from .session_cache import SessionCache

__all__ = [
    "REGISTRY",
    "CacheConfig",
    "CacheError",
    "CacheFull",
    "CacheRegistry",
    "NoActiveCache",
    "PositionMismatch",
    "SessionCache",
    "Sizing",
    "UnknownCache",
    "update_and_attend",
]
