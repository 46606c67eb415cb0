"""One sequence's K/V history for every layer, bounded by a hard capacity.

Storage contract: k is [n_layers, n_kv_heads, allocated, head_dim] and
v is [n_layers, n_kv_heads, allocated, v_head_dim]; tokens [0, length) are valid.
"""
from __future__ import annotations

import torch

from .config import CacheConfig, Sizing
from .errors import CacheFull

_MIN_DYNAMIC_ALLOC = 16


def grown_allocation(allocated: int, needed: int, capacity: int) -> int:
    """Tokens a cache holding `allocated` slots allocates to hold `needed` tokens."""
    if needed <= allocated:
        return allocated
    # Geometric growth keeps appends amortized O(1); the cap keeps memory within the hard bound.
    return min(capacity, max(needed, 2 * allocated, _MIN_DYNAMIC_ALLOC))


class SessionCache:
    """K/V of one session; STATIC preallocates its capacity, DYNAMIC doubles as it grows."""

    def __init__(self, config: CacheConfig, key: str = "") -> None:
        self.config = config
        self.key = key
        self._length = 0
        alloc = config.capacity if config.sizing is Sizing.STATIC else 0
        self._k, self._v = self._allocate(alloc)

    def _allocate(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        k = torch.zeros(c.n_layers, c.n_kv_heads, tokens, c.head_dim, dtype=c.dtype)
        v = torch.zeros(c.n_layers, c.n_kv_heads, tokens, c.value_dim, dtype=c.dtype)
        return k, v

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def allocated(self) -> int:
        return self._k.shape[2]

    @property
    def nbytes(self) -> int:
        return self._k.nbytes + self._v.nbytes

    def can_extend(self, n: int) -> bool:
        return 0 <= n and self._length + n <= self.config.capacity

    def check_extend(self, n: int) -> None:
        if not self.can_extend(n):
            raise CacheFull(self.key, self._length, n, self.config.capacity)

    def allocation_for(self, n: int) -> int:
        """Tokens allocated once n more are held (what reserve(n) would leave), without allocating."""
        return grown_allocation(self.allocated, self._length + n, self.config.capacity)

    def bytes_after(self, n: int) -> int:
        """nbytes once n more tokens are held."""
        return self.config.bytes_for(self.allocation_for(n))

    def reserve(self, n: int) -> None:
        """Make room for n more tokens; raises CacheFull (changing nothing) past capacity."""
        self.check_extend(n)
        alloc = self.allocation_for(n)
        if alloc == self.allocated:
            return
        k, v = self._allocate(alloc)
        k[:, :, : self._length].copy_(self._k[:, :, : self._length])
        v[:, :, : self._length].copy_(self._v[:, :, : self._length])
        self._k, self._v = k, v

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k [H_kv, n, D] and v [H_kv, n, D_v] after the history of `layer` (room must be reserved).

        Returns the layer's whole history including them: [H_kv, length + n, D] and [H_kv, length + n, D_v].
        The length does not move until commit(n), so a step that fails midway leaves the history intact.
        """
        end = self._length + k.shape[1]
        assert end <= self.allocated, "reserve() must run before write()"
        k_layer, v_layer = self._k[layer], self._v[layer]  # [H_kv, allocated, D] views
        k_layer[:, self._length : end] = k
        v_layer[:, self._length : end] = v
        return k_layer[:, :end], v_layer[:, :end]

    def storage(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole K [L, H_kv, allocated, D] and V [L, H_kv, allocated, D_v] buffers, for kernels that append in place."""
        return self._k, self._v

    def commit(self, n: int) -> None:
        assert self._length + n <= self.allocated
        self._length += n

    def history(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Valid K [H_kv, length, D] and V [H_kv, length, D_v] of one layer (views, not copies)."""
        return self._k[layer, :, : self._length], self._v[layer, :, : self._length]

    def rewind(self, n: int) -> None:
        """Forget the last n tokens."""
        if not isinstance(n, int) or n < 0 or n > self._length:
            raise ValueError(f"rewind(n) needs 0 <= n <= length ({self._length}), got {n!r}")
        self._length -= n

    def reset(self) -> None:
        """Forget every token; a DYNAMIC cache also gives its memory back."""
        self._length = 0
        if self.config.sizing is Sizing.DYNAMIC:
            self._k, self._v = self._allocate(0)

    def __repr__(self) -> str:
        c = self.config
        return f"SessionCache({self.key!r}, length={self._length}, capacity={c.capacity}, sizing={c.sizing.value})"
