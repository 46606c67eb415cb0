"""The engine's KV memory: one block pool under the KV budget, and the session caches it holds."""
from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import hashlib

import torch

from kvcache import BlockPool, CacheConfig, CacheRegistry, SessionCache
from kvcache.block_pool import prefix_hashes
from kvcache.disk_tier import DiskTier
from kvcache.session_cache import blocks_for
from models.export import LoadedModel

from .session import Session, common_prefix


def kv_dtype(choice: str, model: LoadedModel) -> torch.dtype:
    """float16 KV beside approximate weights halves KV memory and the bytes attention reads; the exact
    f32 mode keeps the model's dtype, so its outputs stay those of the reference."""
    if choice == "auto":
        return torch.float16 if model.weights != "f32" else model.dtype
    return getattr(torch, choice)


def kv_layout(model: LoadedModel, choice: str, capacity: int = 1) -> CacheConfig:
    """The shape and element type of the model's KV, with the `--kv-dtype` choice, and the window its caches
    may forget behind: the longest, where every layer has one."""
    c = model.config
    windows = c.layer_windows or (0,)
    return CacheConfig(c.n_layers, c.n_kv_heads, c.head_dim, capacity, dtype=kv_dtype(choice, model),
                       window=max(windows) if min(windows) > 0 else 0)


class KVPool:
    """Installs session caches on the engine's block pool (attaching cached prefixes), forks and drops them."""

    def __init__(self, registry: CacheRegistry, budget: int, layout: CacheConfig, shared_prefixes: bool = False) -> None:
        self.registry = registry
        self.shared_prefixes = shared_prefixes  # --shared-prefix-cache: tenants share cached prefixes
        self.layout = layout  # n_layers, heads, dims and dtype; capacity and sizing come per session
        self.blocks = BlockPool.for_budget(layout, budget)
        self.budget = self.blocks.n_blocks * self.blocks.block_bytes
        self.tier: DiskTier | None = None

    def config_for(self, session: Session) -> CacheConfig:
        l = self.layout
        return CacheConfig(l.n_layers, l.n_kv_heads, l.head_dim, session.capacity, l.v_head_dim, session.sizing, l.dtype,
                           l.window)

    def used(self) -> int:
        """Bytes referenced by caches or held back for static ones (cached prefixes nobody holds excluded)."""
        return (self.blocks.n_used() + self.blocks.reserved) * self.blocks.block_bytes

    def blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.blocks.block_size)

    def full_bytes(self, capacity: int) -> int:
        return self.blocks_for(capacity) * self.blocks.block_bytes

    def open_tier(self, folder: str, budget: int, model: LoadedModel, holder: str | None = None) -> DiskTier:
        """Put a disk tier under the block pool, for this model's identity: what its KV depends on. `holder`
        (this process's boot id) names the server in each session claim it takes."""
        blocks = self.blocks
        identity = {"model": model.fingerprint or model.name, "weights": model.weights, "dtype": str(model.dtype),
                    "kv_dtype": str(self.layout.dtype), "block_size": blocks.block_size, "kv_shape": list(blocks.k.shape[1:])}
        self.tier = blocks.tier = DiskTier(Path(folder), budget, identity, blocks.block_bytes, blocks.block_size,
                                           tuple(blocks.k.shape[1:]), tuple(blocks.v.shape[1:]), blocks.k.dtype)
        self.tier.holder = holder
        return self.tier

    def prefetch(self, session: Session):
        """Start reading back from disk the blocks of the session's history that RAM lacks -> a future of
        them, or None (no tier, or nothing to read). The request waits in the queue, never the step."""
        if self.tier is None or not self.tier.healthy or session.cache is not None:
            return None
        b = self.blocks.block_size
        tokens = session.tokens[: min(len(session.tokens) - 1, session.capacity)]
        hashes = prefix_hashes(tokens, b, self.seed(session))
        skip = self.blocks.cached_prefix(hashes)
        if skip == len(hashes) or not self.tier.has(hashes[skip]):
            return None
        return self.tier.prefetch(hashes[skip:], tokens[skip * b :])

    def seed(self, session: Session) -> bytes:
        """Where the session's prefix hash chain starts: its owner's namespace (unless tenants share
        prefixes), and its client's cache_salt within that. No owner and no salt: the chain of a server
        without keys, as every earlier version wrote to the disk tier."""
        owner = None if self.shared_prefixes else session.owner
        if owner is None and session.salt is None:
            return b""
        text = f"{owner or ''}\0{session.salt or ''}".encode()
        return hashlib.blake2b(text, digest_size=16, person=b"kvserve-prefix").digest()

    def persist(self, session: Session) -> Future | None:
        """Write a persistent session's record behind (its blocks go by content, as they fill) -> a future of
        whether it is on disk, or None if no write is tried (no tier, not persistent, a full disk)."""
        if self.tier is None or not session.persistent:
            return None
        self.tier.claim(session.key)  # a new one becomes ours; one already ours stays so
        return self.tier.save_session(session.record())

    def forget(self, session: Session) -> None:
        if self.tier is not None and session.persistent:
            self.tier.delete_session(session.key)

    def ensure(self, session: Session, reuse: Session | None = None, fetched: dict | None = None,
               limit: int | None = None) -> None:
        """Give a session without a cache one, starting from `reuse`'s KV (a fork) or from the longest
        cached prefix of its history (of its first `limit` tokens, if given). Raises PoolExhausted (nothing
        installed) if a static one cannot reserve."""
        if session.cache is not None:
            return
        if reuse is not None and reuse.cache is not None:
            self.fork(reuse, session)
            keep = common_prefix(session.tokens[: len(session.tokens) - 1], reuse.tokens[: session.cache.length])
            session.truncate_cache(keep)
            return
        cache = SessionCache(self.config_for(session), self.blocks, seed=self.seed(session))
        # the last token is always run again: its logits start the reply
        end = len(session.tokens) - 1 if limit is None else min(len(session.tokens) - 1, limit)
        cache.attach_prefix(session.tokens[:end], fetched)
        session.cache = self.registry.install(session.key, cache)

    def fork(self, parent: Session, child: Session) -> None:
        """Give `child` a cache sharing every block of `parent`'s (raises PoolExhausted for a static one
        that cannot reserve its capacity)."""
        child.cache = self.registry.install(child.key, parent.cache.fork())

    def drop(self, session: Session) -> None:
        """Free a session's KV; its full blocks stay cached for a later prefix hit, its history stays too."""
        if session.cache is not None:
            self.registry.uninstall(session.key)
            session.cache = None
