"""Frozen description of one session's KV cache."""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class Sizing(str, enum.Enum):
    """How a cache takes memory: all of its capacity up front, or as it grows."""

    STATIC = "static"
    DYNAMIC = "dynamic"


@dataclass(frozen=True)
class CacheConfig:
    """Shape, hard capacity (tokens) and sizing of one session's K/V for every layer."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    capacity: int
    v_head_dim: int | None = None  # None: same as head_dim
    sizing: Sizing = Sizing.DYNAMIC
    dtype: torch.dtype = torch.float32
    # The longest sliding window of a model whose every layer attends through one (Mistral, Phi-3-4k); 0 when
    # some layer reads the whole history. A token's keys are then never read again once every window has
    # passed them, and the cache gives their blocks back (session_cache.py).
    window: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if self.v_head_dim is not None and (not isinstance(self.v_head_dim, int) or self.v_head_dim <= 0):
            raise ValueError(f"CacheConfig.v_head_dim must be a positive int, got {self.v_head_dim!r}")
        try:
            object.__setattr__(self, "sizing", Sizing(self.sizing))
        except ValueError:
            raise ValueError(f"CacheConfig.sizing must be 'static' or 'dynamic', got {self.sizing!r}") from None
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 0:
            raise ValueError(f"CacheConfig.window must be an int >= 0, got {self.window!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"CacheConfig.dtype must be a floating torch.dtype, got {self.dtype!r}")

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def bytes_per_token(self) -> int:
        # the scheduler asks this for every session of every step: no tensor allocation here
        return self.n_layers * self.n_kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.bytes_per_token()
