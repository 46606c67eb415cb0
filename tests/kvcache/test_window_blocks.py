"""A cache whose every layer attends through a sliding window gives back the blocks every window has passed:
its outputs are those of a cache that keeps everything, bit for bit, in the C++ kernel and the Python path,
through decodes, chunked prefills, short and deep rewinds, and forks; and every block comes back to the pool."""
import pytest
import torch

from kvcache import BlockPool, CacheConfig, SessionCache
from kvcache.session_cache import PASSED, REWIND_MARGIN
from kvcache.step import ActiveStep

from .test_windowed_attention import needs_native

LAYERS, KV_HEADS, Q_HEADS, DIM, WINDOW = 2, 2, 4, 64, 24


def pair(pool_blocks=64, capacity=1024):
    """Two caches on one pool each: one forgets behind its window, the other keeps every block."""
    def one(window):
        config = CacheConfig(LAYERS, KV_HEADS, DIM, capacity, window=window)
        return SessionCache(config, BlockPool(config, pool_blocks))

    return one(WINDOW), one(0)


def step(cache, n, native, gen):
    """One committed and published step of n tokens through every layer, attending through the window -> [L]
    outputs. A block goes back only once published: the prefix cache and the disk tier keep it."""
    q, k, v = (torch.randn(LAYERS, 1, h, n, DIM, generator=gen) for h in (Q_HEADS, KV_HEADS, KV_HEADS))
    active = ActiveStep([(cache, n)], native=native)
    position = torch.arange(cache.length, cache.length + n).unsqueeze(1)
    outs = [active.attend(q[i], k[i], v[i], position, i, DIM**-0.5, torch.float32, WINDOW) for i in range(LAYERS)]
    active.commit()
    cache.publish(list(range(cache.length)))
    return outs


def both(windowed, full, n, native, seed):
    """The same step on each cache -> whether their outputs are the same bits."""
    a = step(windowed, n, native, torch.Generator().manual_seed(seed))
    b = step(full, n, native, torch.Generator().manual_seed(seed))
    return all(torch.equal(x, y) for x, y in zip(a, b))


def held(cache):
    return sum(block != PASSED for block in cache.table)


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_passed_blocks_go_back_and_outputs_stay_the_same(native):
    if native:
        needs_native()
    windowed, full = pair()
    for i, n in enumerate([40, 1, 1, 70, *[1] * 60, 33, *[1] * 40]):
        assert both(windowed, full, n, native, i), (i, windowed.length)
    b = windowed.block_size
    assert windowed.length == full.length == 245
    # what a window and the margin span, and the block the next token goes into: no more
    assert held(windowed) <= (WINDOW + REWIND_MARGIN) // b + 2 < held(full) == -(-245 // b)
    assert windowed.pool.n_used() == held(windowed) and windowed.nbytes == held(windowed) * windowed.pool.block_bytes
    assert windowed.pool.n_cached() == windowed.table.count(PASSED)  # given back as cached prefixes, reusable
    windowed.release()
    assert windowed.pool.n_used() == 0 and windowed.table == []


def test_a_block_goes_back_only_once_published():
    windowed, _ = pair()
    active = ActiveStep([(windowed, 200)])
    q, k, v = torch.randn(1, Q_HEADS, 200, DIM), torch.randn(1, KV_HEADS, 200, DIM), torch.randn(1, KV_HEADS, 200, DIM)
    for i in range(LAYERS):
        active.attend(q, k, v, torch.arange(200).unsqueeze(1), i, 0.125, torch.float32, WINDOW)
    active.commit()
    assert PASSED not in windowed.table  # a 200-token prefill: its first blocks passed, but are not indexed yet
    windowed.publish(list(range(200)))
    assert windowed.table.count(PASSED) == (200 - WINDOW - REWIND_MARGIN) // windowed.block_size


def test_short_rewinds_keep_the_window_and_deep_ones_start_over():
    needs_native()
    windowed, full = pair()
    for i in range(12):
        both(windowed, full, 20, True, i)
    passed = windowed.table.count(PASSED)
    assert passed > 0
    # a reply's last token and five rejected drafts, taken back: the window is still whole
    windowed.rewind(6), full.rewind(6)
    assert windowed.length == full.length == 234 and windowed.table.count(PASSED) == passed
    assert both(windowed, full, 3, True, 100)
    # a rewind whose next token would read given-back keys: nothing is kept, the history comes again
    windowed.rewind(REWIND_MARGIN + 10)
    assert windowed.length == 0 and windowed.table == [] and windowed.pool.n_used() == 0
    full.reset()
    assert both(windowed, full, 50, True, 101) and both(windowed, full, 1, True, 102)


def test_a_fork_shares_only_the_blocks_still_held():
    needs_native()
    windowed, full = pair()
    for i in range(10):
        both(windowed, full, 25, True, i)
    child, twin = windowed.fork("child"), full.fork("twin")
    assert child.table == windowed.table and child.pool.n_used() == held(windowed)
    assert both(child, twin, 7, True, 50) and both(windowed, full, 3, True, 51)
    child.release(), windowed.release()
    assert windowed.pool.n_used() == 0
