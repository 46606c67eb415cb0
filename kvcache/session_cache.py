"""One sequence's K/V history for every layer: a block table into a pool, bounded by a hard capacity.

Token t of the history lies in block table[t // B] of the pool, at row t % B. Blocks before the
last may be shared with other caches (a forked session, a cached prefix); a shared block is never
written: the first write into one copies it (copy on write), so sharing is invisible to every cache.

A cache whose every layer attends through a sliding window (CacheConfig.window) gives back the blocks
that every window has passed, once published: they stay in the table as holes (PASSED), which no
attention reads. A few tokens more than the window are kept (REWIND_MARGIN), so a reply's last token or
rejected drafts can be taken back; a rewind deeper than that, whose next token would need passed keys,
empties the cache, and the history is prefilled again.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .block_pool import DEFAULT_BLOCK_SIZE, BlockPool, prefix_hashes
from .config import CacheConfig, Sizing
from .errors import CacheError, CacheFull, PoolExhausted


PASSED = -1  # a table entry whose block went back to the pool: every window had passed it
REWIND_MARGIN = 64  # tokens kept beyond a window, so a short rewind still finds every key its next token reads


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class SessionCache:
    """K/V of one session; STATIC reserves its capacity in the pool up front, DYNAMIC takes blocks as it grows."""

    def __init__(self, config: CacheConfig, pool: BlockPool | None = None, key: str = "", seed: bytes = b"") -> None:
        if pool is None:  # a cache on its own gets a private pool of exactly its capacity
            pool = BlockPool(config, blocks_for(config.capacity, DEFAULT_BLOCK_SIZE))
        p = pool.layout
        if (p.n_layers, p.n_kv_heads, p.head_dim, p.value_dim, p.dtype) != (
            config.n_layers, config.n_kv_heads, config.head_dim, config.value_dim, config.dtype
        ):
            raise CacheError("a cache's layers, heads, dims and dtype must match its pool's")
        self.config, self.pool, self.key = config, pool, key
        # Where its blocks' hash chain starts: its prefix namespace. Caches with different seeds never share a
        # cached prefix, so one tenant can neither hit nor time another's blocks (block_pool.prefix_hashes).
        self.seed = seed
        self.table: list[int] = []  # block ids, ceil(length / B) of them outside a step
        self._passed = 0  # leading table entries that are PASSED holes (a windowed cache's)
        self._length = 0
        self._hashes: list[bytes] = []  # chained hash of each full block published so far
        self._reserved = 0  # STATIC: blocks still held back for this cache in the pool
        if config.sizing is Sizing.STATIC:
            pool.reserve(self.max_blocks)
            self._reserved = self.max_blocks

    # ---- sizes ---------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def max_blocks(self) -> int:
        return blocks_for(self.config.capacity, self.pool.block_size)

    @property
    def allocated(self) -> int:
        """Tokens of storage held (whole blocks), shared blocks included."""
        return len(self.table) * self.pool.block_size

    @property
    def nbytes(self) -> int:
        """Bytes this cache holds or has reserved in the pool, shared blocks included."""
        return (len(self.table) - self._passed + self._reserved) * self.pool.block_bytes

    def read_table(self) -> list[int]:
        """The block table as attention reads it: a passed hole names the first block still held. Only keys
        before every window lie there, which a kernel may touch while it masks them, never uses."""
        if not self._passed:
            return self.table
        return [self.table[self._passed]] * self._passed + self.table[self._passed :]

    def can_extend(self, n: int) -> bool:
        return 0 <= n and self._length + n <= self.config.capacity

    def check_extend(self, n: int) -> None:
        if not self.can_extend(n):
            raise CacheFull(self.key, self._length, n, self.config.capacity)

    def _copy_on_write(self, n: int) -> bool:
        """Whether writing n tokens starts inside a block that others see."""
        b = self.pool.block_size
        return n > 0 and self._length % b != 0 and self.pool.is_shared(self.table[self._length // b])

    def pool_demand(self, n: int) -> int:
        """Unreserved pool blocks that reserve(n) would take: new blocks (DYNAMIC) and a copy on write."""
        grow = max(0, blocks_for(self._length + n, self.pool.block_size) - len(self.table))
        return max(0, grow - self._reserved) + self._copy_on_write(n)

    # ---- a step: reserve, write, commit --------------------------------------------------------
    def reserve(self, n: int) -> None:
        """Make room for n more tokens; raises CacheFull or PoolExhausted (changing nothing)."""
        self.check_extend(n)
        demand = self.pool_demand(n)
        if demand > self.pool.available():
            raise PoolExhausted(demand, self.pool.available())
        if self._copy_on_write(n):
            at = self._length // self.pool.block_size
            shared = self.table[at]
            self.table[at] = self.pool.copy(shared)
            self.pool.release(shared)
        while len(self.table) < blocks_for(self._length + n, self.pool.block_size):
            reserved = self._reserved > 0
            self.table.append(self.pool.allocate(reserved))
            self._reserved -= reserved

    def commit(self, n: int) -> None:
        assert self._length + n <= self.allocated
        self._length += n
        self._give_back_passed()

    def _give_back_passed(self) -> None:
        """Release the blocks wholly before every window of the next token, less REWIND_MARGIN, once published:
        an indexed block stays in the pool's prefix cache (and on disk), so a later request or a restored
        session still starts from it."""
        w = self.config.window
        if w == 0:
            return
        keep_from = min(max(0, self._length - w - REWIND_MARGIN) // self.pool.block_size, len(self._hashes))
        for i in range(self._passed, keep_from):
            self.pool.release(self.table[i])
            self.table[i] = PASSED
        self._passed = max(self._passed, keep_from)
    def trim(self) -> None:
        """Give back blocks past the history (after a rewind, or a step that did not commit)."""
        keep = blocks_for(self._length, self.pool.block_size)
        for block in self.table[keep:]:
            if block != PASSED:
                self.pool.release(block)
        del self.table[keep:]
        self._passed = min(self._passed, keep)
        del self._hashes[self._length // self.pool.block_size :]
        if self.config.sizing is Sizing.STATIC:
            # hold back again what was given up, as far as the pool can (a block still shared elsewhere frees nothing)
            take = min(self.max_blocks - len(self.table) - self._reserved, max(self.pool.available(), 0))
            self.pool.reserve(take)
            self._reserved += take

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k [H_kv, n, D] and v [H_kv, n, D_v] after the history of `layer` (room must be reserved).

        Returns a copy of the layer's whole history including them: [H_kv, length + n, D], [H_kv, length + n, D_v].
        The length does not move until commit(n), so a step that fails midway leaves the history intact.
        """
        n, b = k.shape[1], self.pool.block_size
        assert self._length + n <= self.allocated, "reserve() must run before write()"
        slots = torch.arange(self._length, self._length + n)
        blocks = torch.tensor(self.table, dtype=torch.long)[slots // b]
        self.pool.k[blocks, layer, :, :, slots % b] = k.transpose(0, 1).to(self.pool.k.dtype)  # [n, H_kv, D]
        self.pool.v[blocks, layer, :, slots % b] = v.transpose(0, 1).to(self.pool.v.dtype)
        return self.history(layer, self._length + n)

    def history(self, layer: int, end: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K [H_kv, end, D] and V [H_kv, end, D_v] of one layer, gathered from the blocks (copies)."""
        end = self._length if end is None else end
        blocks = torch.tensor(self.read_table()[: blocks_for(end, self.pool.block_size)], dtype=torch.long)

        def gather(rows: torch.Tensor) -> torch.Tensor:  # [nb, H_kv, B, D]
            return rows.transpose(0, 1).reshape(rows.shape[1], -1, rows.shape[-1])[:, :end]  # [H_kv, nb * B, D] -> [H_kv, end, D]

        return gather(self.pool.k[blocks, layer].transpose(-1, -2)), gather(self.pool.v[blocks, layer])

    # ---- history edits -------------------------------------------------------------------------
    def rewind(self, n: int) -> None:
        """Forget the last n tokens (blocks no longer needed go back to the pool). A windowed cache that would
        then need keys it gave back forgets every token."""
        if not isinstance(n, int) or n < 0 or n > self._length:
            raise ValueError(f"rewind(n) needs 0 <= n <= length ({self._length}), got {n!r}")
        self._length -= n
        if self._passed and self._length - self.config.window + 1 < self._passed * self.pool.block_size:
            self._length = 0
        self.trim()

    def reset(self) -> None:
        """Forget every token; a DYNAMIC cache gives its blocks back, a STATIC one keeps its reservation."""
        self.rewind(self._length)

    def release(self) -> None:
        """Give every block and reservation back to the pool; the cache is empty afterwards."""
        self.pool.unreserve(self._reserved)
        self._reserved = 0
        self._length = 0
        for block in self.table[self._passed :]:
            self.pool.release(block)
        self.table, self._hashes, self._passed = [], [], 0

    def publish(self, tokens: Sequence[int], durable: bool = False) -> None:
        """Record the ids of the history, tokens[:length], beside its KV, and index its full blocks for
        prefix reuse (and, `durable`, write them behind to the pool's disk tier). Rows already published
        keep the ids they have: an indexed block is never written."""
        b, done = self.pool.block_size, len(self._hashes)
        for i in range(done, blocks_for(self._length, b)):
            if not self.pool.indexed(self.table[i]):  # (one kept through a rewind holds these ids already)
                self.pool.record(self.table[i], tokens[i * b : min((i + 1) * b, self._length)])
        fresh = prefix_hashes(tokens[done * b : self._length // b * b], b, self._hashes[-1] if self._hashes else self.seed)
        parent = self._hashes[-1] if self._hashes else None
        for block, digest in zip(self.table[done:], fresh):
            self.pool.publish(block, digest, durable, parent)
            parent = digest
        self._hashes += fresh
        self._give_back_passed()

    def attach_prefix(self, tokens: Sequence[int], fetched: dict | None = None) -> int:
        """Start an empty cache from the longest cached prefix of `tokens` (whole blocks), in RAM or among
        the `fetched` blocks read back from disk -> tokens reused."""
        assert self._length == 0 and not self.table, "only an empty cache attaches a prefix"
        limit = min(len(tokens), self.config.capacity)
        hashes = prefix_hashes(tokens[:limit], self.pool.block_size, self.seed)
        self.table = self.pool.match(hashes, tokens[:limit], fetched)
        self._take()
        self._hashes = hashes[: len(self.table)]
        self._length = len(self.table) * self.pool.block_size
        return self._length

    def fork(self, key: str = "") -> SessionCache:
        """A cache with the same history that shares every block; either side copies a block it writes into."""
        child = SessionCache(self.config, self.pool, key, self.seed)
        for block in self.table[self._passed :]:
            self.pool.share(block)
        child.table, child._hashes, child._length = list(self.table), list(self._hashes), self._length
        child._passed = self._passed
        child._take()
        return child

    def _take(self) -> None:
        """Blocks joined the table without an allocation: hold back no more than the rest of the capacity."""
        excess = max(0, self._reserved - (self.max_blocks - len(self.table)))
        self.pool.unreserve(excess)
        self._reserved -= excess

    def __repr__(self) -> str:
        c = self.config
        return f"SessionCache({self.key!r}, length={self._length}, capacity={c.capacity}, sizing={c.sizing.value})"
