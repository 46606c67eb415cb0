"""One engine's KV memory: fixed-size blocks with reference counts and an index of cached prefixes.

Storage contract: k is [n_blocks, n_layers, n_kv_heads, head_dim, block_size] and v is
[n_blocks, n_layers, n_kv_heads, block_size, v_head_dim]: keys are held transposed within a block, as
the attention kernel reads them (a vector over keys per head dim). A block holds block_size consecutive
tokens of one history for every layer, so copying or dropping it moves whole tokens.

Why block hashing (vLLM, nano-vllm) rather than a radix tree (SGLang): a session is already a list
of blocks for the native kernel to read, and a full block's hash chains over the hash of the block
before it, so finding a cached prefix is one dictionary look-up per block and sharing it is a
reference count. A radix tree matches at token granularity, but only whole blocks can be shared
without a copy, and the tree would be a second structure over the same blocks.

Why a hit re-checks token ids (as nano-vllm's block manager does): each block records the ids of the
tokens it holds, beside its KV. A prefix hit compares them with the request's tokens before sharing
the block, so a stale index entry or a hash collision costs a recompute, never a wrong answer.
"""
from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Sequence

import torch

from .config import CacheConfig
from .errors import PoolExhausted

DEFAULT_BLOCK_SIZE = 16

log = logging.getLogger("kvserve.kvcache")


def chain_hash(previous: bytes, tokens: Sequence[int]) -> bytes:
    """The identity of a full block: its tokens and, through `previous`, every token before them."""
    return hashlib.blake2b(previous + array("q", tokens).tobytes(), digest_size=16).digest()


def prefix_hashes(tokens: Sequence[int], block_size: int, previous: bytes = b"") -> list[bytes]:
    """Chained hashes of each full block of `tokens`, continuing from the hash of the block before them
    (or, for a history's first block, from its cache's seed: a namespace, such as a tenant's salt)."""
    out, h = [], previous
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = chain_hash(h, tokens[start : start + block_size])
        out.append(h)
    return out


class BlockPool:
    """Blocks shared by every session cache of one engine: free, referenced, or cached for reuse.

    A block is in exactly one state: free (on the free stack), referenced (refs > 0), or cached (refs
    == 0 but its full, hashed content kept for a later prefix hit, in least-recently-used order).
    Allocation takes a free block first, then evicts the oldest cached one; a referenced block is never
    taken. Static caches reserve their capacity up front: `reserved` blocks are held back for them.
    """

    def __init__(self, layout: CacheConfig, n_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 4 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two of at least 4, got {block_size}")
        if n_blocks <= 0:
            raise ValueError(f"a pool needs at least one block, got {n_blocks}")
        self.layout, self.n_blocks, self.block_size = layout, n_blocks, block_size
        shape = (n_blocks, layout.n_layers, layout.n_kv_heads, block_size)
        # torch.empty maps the pages without touching them: memory becomes resident as blocks are written.
        self.k = torch.empty(*shape[:3], layout.head_dim, block_size, dtype=layout.dtype)
        self.v = torch.empty(*shape, layout.value_dim, dtype=layout.dtype)
        self.refs = [0] * n_blocks
        self.ids = array("q", bytes(8 * n_blocks * block_size))  # block b's token ids: ids[b * B : (b + 1) * B]
        self.mismatches = 0  # prefix hits refused because a block's ids were not the request's (a bug)
        self._free = list(range(n_blocks - 1, -1, -1))  # a stack: low ids first, so reused pages stay warm
        self._cached: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._parent_of: dict[int, bytes | None] = {}  # an indexed block's predecessor's hash: a disk copy keeps the chain
        self.reserved = 0
        self.tier = None  # a DiskTier: durable blocks, and cached ones the pool evicts, are written behind to it
        # What the prefix index gained and lost, in order, while a listener (KV events for a router) drains it:
        # ("stored", digest, parent digest or None, token ids) and ("removed", digest). None: nobody listens.
        self.events: list[tuple] | None = None

    @classmethod
    def for_budget(cls, layout: CacheConfig, budget: int, block_size: int = DEFAULT_BLOCK_SIZE) -> BlockPool:
        return cls(layout, max(1, budget // (layout.bytes_per_token() * block_size)), block_size)

    @property
    def block_bytes(self) -> int:
        return self.layout.bytes_per_token() * self.block_size

    # ---- accounting ------------------------------------------------------------------------
    def available(self) -> int:
        """Blocks an unreserved allocation may still take (free, or cached and evictable)."""
        return len(self._free) + len(self._cached) - self.reserved

    def n_free(self) -> int:
        return len(self._free)

    def n_cached(self) -> int:
        return len(self._cached)

    def n_used(self) -> int:
        return self.n_blocks - len(self._free) - len(self._cached)

    def reserve(self, n: int) -> None:
        if n > self.available():
            raise PoolExhausted(n, self.available())
        self.reserved += n

    def unreserve(self, n: int) -> None:
        assert 0 <= n <= self.reserved
        self.reserved -= n

    # ---- blocks ------------------------------------------------------------------------------
    def allocate(self, reserved: bool = False) -> int:
        """A block with one reference; `reserved` draws on a reservation made earlier."""
        if reserved:
            self.unreserve(1)
        elif self.available() <= 0:
            raise PoolExhausted(1, self.available())
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._cached.popitem(last=False)  # the least recently used cached prefix goes
            digest = self._hash_of.pop(block)
            del self._block_of[digest]
            self._note("removed", digest)
            self._spill(block, digest, self._parent_of.pop(block))  # to disk, rather than dropped
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self._cached[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} released with no reference"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self._hash_of:
                self._cached[block] = None  # newest at the end
            else:
                self._free.append(block)

    def indexed(self, block: int) -> bool:
        return block in self._hash_of

    def is_shared(self, block: int) -> bool:
        """Whether writing into `block` would change what another cache or the prefix index sees."""
        return self.refs[block] > 1 or self.indexed(block)

    def copy(self, block: int, reserved: bool = False) -> int:
        """A private copy of `block` (copy on write), with one reference."""
        fresh = self.allocate(reserved)
        self.k[fresh].copy_(self.k[block])
        self.v[fresh].copy_(self.v[block])
        b = self.block_size
        self.ids[fresh * b : (fresh + 1) * b] = self.ids[block * b : (block + 1) * b]
        return fresh

    def record(self, block: int, tokens: Sequence[int]) -> None:
        """Note the ids of the tokens whose KV lies in `block`, from its first row on."""
        at = block * self.block_size
        self.ids[at : at + len(tokens)] = array("q", tokens)

    def tokens_of(self, block: int) -> list[int]:
        return self.ids[block * self.block_size : (block + 1) * self.block_size].tolist()

    # ---- the prefix index --------------------------------------------------------------------
    def publish(self, block: int, digest: bytes, durable: bool = False, parent: bytes | None = None) -> None:
        """Index a full block by its chained hash (`parent`: the block before it's); a second block with the
        same content stays private. A durable block (a persistent session's) is also written behind to
        the disk tier."""
        if digest not in self._block_of and block not in self._hash_of:
            self._block_of[digest] = block
            self._hash_of[block] = digest
            self._parent_of[block] = parent
            self._note("stored", digest, parent, self.tokens_of(block))
        if durable:
            self._spill(block, digest, parent)

    def _note(self, *event) -> None:
        if self.events is not None:
            self.events.append(event)

    def _spill(self, block: int, digest: bytes, parent: bytes | None) -> None:
        """Hand the disk tier a copy of a full block (the pool may reuse the block at once)."""
        if self.tier is not None and self.tier.healthy and not self.tier.has(digest):
            self.tier.offer(digest, self.tokens_of(block), self.k[block].clone(), self.v[block].clone(), parent)

    def cached_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` the index holds now."""
        n = 0
        while n < len(hashes) and hashes[n] in self._block_of:
            n += 1
        return n

    def match(self, hashes: Sequence[bytes], tokens: Sequence[int], fetched: dict | None = None) -> list[int]:
        """The cached blocks of the longest indexed prefix of `hashes` (the chained hashes of `tokens`'s full
        blocks) whose recorded ids are those tokens, each given one more reference. A block the index
        lacks may come from `fetched` ({digest: (k, v)} read back from disk, ids checked there): it is
        copied into a fresh block and indexed."""
        blocks, b = [], self.block_size
        for i, digest in enumerate(hashes):
            block = self._block_of.get(digest)
            if block is None:
                if not fetched or digest not in fetched or self.available() <= 0:
                    break
                block = self.allocate()
                k, v = fetched[digest]
                self.k[block].copy_(k)
                self.v[block].copy_(v)
                self.record(block, tokens[i * b : (i + 1) * b])
                self.publish(block, digest, parent=hashes[i - 1] if i else None)
                blocks.append(block)
                continue
            if self.ids[block * b : (block + 1) * b] != array("q", tokens[i * b : (i + 1) * b]):
                self._mismatch(block)
                break
            if self.refs[block] == 0 and self.available() <= 0:
                break  # an unreferenced cached block is room a static cache's reservation counts on
            self.share(block)
            blocks.append(block)
        return blocks

    def index(self) -> dict[bytes, int]:
        """The prefix index: chained hash -> the block holding that prefix's last full block."""
        return dict(self._block_of)

    def _mismatch(self, block: int) -> None:
        """An indexed block whose ids are not those its hash promised: never serve it, forget it, recompute."""
        self.mismatches += 1
        log.error("prefix cache: block %d is indexed under a hash its token ids do not match; dropped from the index", block)
        digest = self._hash_of.pop(block)
        del self._block_of[digest]
        del self._parent_of[block]
        self._note("removed", digest)
        if self.refs[block] == 0:
            del self._cached[block]
            self._free.append(block)

    def check(self) -> None:
        """Assert the pool's invariants (tests and drills)."""
        free, cached = set(self._free), set(self._cached)
        referenced = {b for b, r in enumerate(self.refs) if r > 0}
        assert len(free) == len(self._free), "a block is on the free stack twice"
        assert not (free & cached) and not (free & referenced) and not (cached & referenced)
        assert len(free) + len(cached) + len(referenced) == self.n_blocks
        assert all(self.refs[b] >= 0 for b in range(self.n_blocks))
        assert cached <= set(self._hash_of) and not (free & set(self._hash_of))
        assert all(self._block_of[h] == b for b, h in self._hash_of.items())
        assert 0 <= self.reserved <= len(free) + len(cached)
        assert len(self.ids) == self.n_blocks * self.block_size
