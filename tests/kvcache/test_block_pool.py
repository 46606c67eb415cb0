"""The shared block pool: reference counts, copy on write, the prefix index, and per-thread steps."""
import random
import threading

import pytest
import torch

from kvcache import BlockPool, CacheRegistry, PoolExhausted, SessionCache, Sizing
from kvcache.block_pool import prefix_hashes

from .tiny_attention import TinyAttention, positions

MODEL = TinyAttention()


def layout(capacity=256, sizing=Sizing.DYNAMIC):
    return MODEL.cache_config(capacity, sizing)


def fill(registry, key, x, start=0):
    """Run x [1, n, 32] through the model on `key`'s cache from position `start` -> [1, n, 32]."""
    with registry.active(key):
        return MODEL(x, positions(start, x.shape[1]))


def histories(cache):
    return [t.clone() for layer in range(cache.config.n_layers) for t in cache.history(layer)]


def test_fork_shares_every_block_and_copies_only_the_partial_one_it_writes():
    pool, registry = BlockPool(layout(), 64), CacheRegistry()
    parent = registry.install("p", SessionCache(layout(), pool))
    x = torch.randn(1, 40, 32)
    fill(registry, "p", x)  # 40 tokens: two full blocks and 8 rows of a third
    before, used = histories(parent), pool.n_used()
    child = registry.install("c", parent.fork())
    assert child.table == parent.table and pool.n_used() == used  # sharing takes no block
    y = torch.randn(1, 5, 32)
    out = fill(registry, "c", y, start=40)
    torch.testing.assert_close(out, MODEL.reference(torch.cat([x, y], 1))[:, 40:], atol=1e-4, rtol=0)
    assert child.table[:2] == parent.table[:2] and child.table[2] != parent.table[2]  # copy on write
    assert pool.n_used() == used + 1
    assert all(torch.equal(a, b) for a, b in zip(histories(parent), before))  # the parent saw nothing
    z = torch.randn(1, 3, 32)  # the parent diverges in its own block
    out = fill(registry, "p", z, start=40)
    torch.testing.assert_close(out, MODEL.reference(torch.cat([x, z], 1))[:, 40:], atol=1e-4, rtol=0)
    assert child.length == 45 and parent.length == 43
    for cache in (parent, child):
        registry.uninstall(cache.key)
    pool.check()
    assert pool.n_used() == 0 and sum(pool.refs) == 0


def test_rewinding_into_a_shared_block_leaves_the_sharers_as_they_were():
    pool, registry = BlockPool(layout(), 64), CacheRegistry()
    a = registry.install("a", SessionCache(layout(), pool))
    x = torch.randn(1, 40, 32)
    fill(registry, "a", x)
    b = registry.install("b", a.fork())
    snapshot = histories(a)
    b.rewind(30)  # b keeps 10 tokens: into block 0, which a still holds
    y = torch.randn(1, 7, 32)
    out = fill(registry, "b", y, start=10)
    torch.testing.assert_close(out, MODEL.reference(torch.cat([x[:, :10], y], 1))[:, 10:], atol=1e-4, rtol=0)
    assert b.table[0] != a.table[0]
    assert a.length == 40 and all(torch.equal(p, q) for p, q in zip(histories(a), snapshot))
    pool.check()


def test_published_prefixes_are_found_evicted_lru_and_never_while_referenced():
    pool, registry = BlockPool(layout(), 6, block_size=4), CacheRegistry()
    tokens = list(range(100, 112))  # three full blocks
    a = registry.install("a", SessionCache(layout(), pool))
    fill(registry, "a", torch.randn(1, 12, 32))
    a.publish(tokens)
    b = SessionCache(layout(), pool, "b")
    assert b.attach_prefix(tokens + [7, 8]) == 12 and b.table == a.table
    b.release()
    registry.uninstall("a")  # its hashed blocks stay cached, held by nobody
    assert pool.n_cached() == 3 and pool.n_free() == 3
    held = SessionCache(layout(), pool, "held")
    assert held.attach_prefix(tokens[:8]) == 8  # the first two blocks are referenced again
    blocks = [pool.allocate() for _ in range(4)]  # three free, then the one cached block nobody holds
    assert held.table[0] not in blocks and held.table[1] not in blocks
    with pytest.raises(PoolExhausted):
        pool.allocate()  # every block is referenced now: none is taken from under its holder
    pool.check()
    assert SessionCache(layout(), pool).attach_prefix(tokens) == 8  # the evicted third block is gone from the index
    for block in blocks:
        pool.release(block)
    pool.check()


def test_a_prefix_hit_never_takes_the_room_a_static_cache_reserved():
    """Found by the pool's state machine: a cached block nobody holds is room a static cache's reservation
    counts on, so a prefix hit may not take it then; the static cache still fills its whole capacity."""
    pool, registry = BlockPool(layout(), 6, block_size=4), CacheRegistry()
    tokens = list(range(100, 112))
    a = registry.install("a", SessionCache(layout(), pool))
    fill(registry, "a", torch.randn(1, 12, 32))
    a.publish(tokens)
    registry.uninstall("a")  # three cached blocks, three free
    static = registry.install("s", SessionCache(layout(24, Sizing.STATIC), pool))  # reserves all six
    assert pool.available() == 0
    late = SessionCache(layout(), pool, "late")
    assert late.attach_prefix(tokens) == 0  # the hit would eat the reservation: it is not taken
    pool.check()
    fill(registry, "s", torch.randn(1, 24, 32))  # every reserved block is there to take
    assert static.length == 24
    pool.check()


def test_reference_counts_return_to_zero_after_many_aborted_steps():
    rng = random.Random(0)
    pool, registry = BlockPool(layout(64), 40, block_size=4), CacheRegistry()
    for i in range(300):
        key = f"r{i}"
        cache = registry.install(key, SessionCache(layout(64, rng.choice(list(Sizing))), pool))
        n = rng.randint(1, 30)
        fill(registry, key, torch.randn(1, n, 32))
        cache.publish([rng.randint(0, 3) for _ in range(n)])  # few distinct prefixes: many hits
        sibling = registry.install(key + "f", cache.fork()) if rng.random() < 0.5 else None
        step = registry.set_active([(key, rng.randint(1, 20))])  # reserved, then aborted: as a failed forward
        step.abort()
        registry.set_active(None)
        assert cache.length == n
        pool.check()
        if sibling is not None:
            registry.uninstall(sibling.key)
        registry.uninstall(key)
        pool.check()
    assert sum(pool.refs) == 0 and pool.reserved == 0 and pool.n_used() == 0
    assert pool.n_free() + pool.n_cached() == pool.n_blocks


def test_static_caches_reserve_their_capacity_and_refuse_past_the_pool():
    pool = BlockPool(layout(), 10, block_size=4)
    static = SessionCache(layout(16, Sizing.STATIC), pool)
    assert pool.reserved == 4 and pool.available() == 6 and static.nbytes == 4 * pool.block_bytes
    with pytest.raises(PoolExhausted):
        SessionCache(layout(32, Sizing.STATIC), pool)
    assert pool.reserved == 4  # the refused one reserved nothing
    static.release()
    assert pool.reserved == 0 and pool.available() == 10


def test_two_registries_on_two_threads_never_read_each_others_step():
    """Two engines in one process each step on their own thread with their own registry."""
    results, errors = {}, []
    barrier = threading.Barrier(2)

    def engine(name, seed):
        try:
            torch.manual_seed(seed)
            x = torch.randn(1, 24, 32)
            registry = CacheRegistry()
            registry.install(name, SessionCache(layout()))
            outs = []
            for i in range(24):  # one token a step, each step activated, run and committed in turn
                barrier.wait()
                step = registry.set_active([(name, 1)])
                outs.append(MODEL(x[:, i : i + 1], positions(i, 1)))
                step.commit()
                registry.set_active(None)
            results[name] = (torch.cat(outs, 1), MODEL.reference(x))
        except Exception as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=engine, args=(n, s)) for n, s in (("one", 1), ("two", 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, want in results.values():
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_prefix_hashes_chain_over_the_whole_prefix():
    a, b = prefix_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), prefix_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, different history
    assert prefix_hashes([1, 2, 3], 4) == []
