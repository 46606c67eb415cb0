"""The block pool and its session caches against a plain model: each sequence is a list of token ids.

Hypothesis drives random interleavings of every operation the server performs on the pool (create,
attach a cached prefix, a multi-session step that commits or aborts, fork, rewind, reset, drop) on a
pool small enough that allocations evict cached prefixes all the time. After every operation the pool's
own invariants hold, every block a cache references records the reference's token ids, every indexed
block holds exactly what its hash stands for, and each cache's KV, written as a known function of token
and position, reads back through its block table as the reference says it should.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import BlockPool, CacheConfig, CacheFull, PoolExhausted, SessionCache, Sizing
from kvcache.block_pool import prefix_hashes
from kvcache.step import ActiveStep

B, N_BLOCKS, LAYERS = 4, 14, 2
VOCAB = st.integers(0, 2)  # few distinct ids: histories share prefixes, so hits and copies are common


def layout(capacity: int = 64, sizing: Sizing = Sizing.DYNAMIC) -> CacheConfig:
    return CacheConfig(n_layers=LAYERS, n_kv_heads=1, head_dim=3, capacity=capacity, sizing=sizing)


def fake_kv(layers: range, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows [len(layers), 1, n, 3] that name their token, position and layer (exact in float32)."""
    n = len(tokens)
    rows = torch.stack([torch.tensor(tokens, dtype=torch.float32).expand(len(layers), n),
                        torch.arange(start, start + n, dtype=torch.float32).expand(len(layers), n),
                        torch.tensor(list(layers), dtype=torch.float32).unsqueeze(1).expand(len(layers), n)], -1)
    return rows.unsqueeze(1), (rows * torch.tensor([1.0, 1.0, -1.0]) + 0.5).unsqueeze(1)


def read_back(pool: BlockPool, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every layer's K and V of a block table's first `length` rows: [n_layers, 1, length, 3] each."""
    def gather(rows: torch.Tensor) -> torch.Tensor:  # [nb, L, H, B, D]
        return rows.permute(1, 2, 0, 3, 4).reshape(LAYERS, 1, -1, 3)[:, :, :length]  # [L, H, nb * B, D] -> [L, H, length, D]
    blocks = torch.tensor(table, dtype=torch.long)
    return gather(pool.k[blocks].transpose(-1, -2)), gather(pool.v[blocks])  # keys are held [D, B] a block


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(layout(), N_BLOCKS, block_size=B)
        self.ref: dict[str, list[int]] = {}  # cache key -> the tokens its history holds
        self.live: dict[str, SessionCache] = {}  # in creation order, so that draws replay exactly
        self.made = 0
        self.meaning: dict[bytes, tuple[int, ...]] = {}  # every published hash -> the whole prefix it stands for

    # ---- helpers ---------------------------------------------------------------------------------
    def _adopt(self, cache: SessionCache, tokens: list[int]) -> SessionCache:
        self.made += 1
        cache.key = f"c{self.made}"
        self.live[cache.key], self.ref[cache.key] = cache, list(tokens)
        return cache

    def _publish(self, cache: SessionCache) -> None:
        tokens = self.ref[cache.key]
        for i, digest in enumerate(prefix_hashes(tokens, B)):
            self.meaning.setdefault(digest, tuple(tokens[: (i + 1) * B]))
        cache.publish(tokens)

    def _snapshot(self):
        p = self.pool
        caches = {k: (list(c.table), c.length, c._reserved) for k, c in self.live.items()}
        return list(p.refs), p.n_free(), p.n_cached(), p.reserved, p.index(), caches

    # ---- rules -----------------------------------------------------------------------------------
    def _pick(self, data, nonempty: bool = False) -> SessionCache:
        keys = [k for k, c in self.live.items() if c.length or not nonempty]
        return self.live[data.draw(st.sampled_from(keys))]

    @rule(sizing=st.sampled_from(Sizing), capacity=st.integers(1, 40))
    @precondition(lambda self: len(self.live) < 6)
    def create(self, sizing, capacity):
        before = self._snapshot()
        try:
            cache = self._adopt(SessionCache(layout(capacity, sizing), self.pool), [])
            assert cache._reserved == (cache.max_blocks if sizing is Sizing.STATIC else 0)
        except PoolExhausted:
            assert sizing is Sizing.STATIC and self._snapshot() == before

    @rule(tokens=st.lists(VOCAB, min_size=1, max_size=24))
    @precondition(lambda self: len(self.live) < 6)
    def attach(self, tokens):
        cache = SessionCache(layout(), self.pool)
        reused = cache.attach_prefix(tokens)
        assert reused % B == 0 and reused <= len(tokens)
        self._adopt(cache, tokens[:reused])

    @rule(data=st.data(), commit=st.booleans())
    @precondition(lambda self: self.live)
    def step(self, data, commit):
        """One forward over several caches: begin (validated, reserved), its layers, then commit or abort."""
        pick = data.draw(st.lists(st.sampled_from(list(self.live)), min_size=1, max_size=3, unique=True))
        spans = [(self.live[k], data.draw(st.integers(1, 9))) for k in pick]
        chunks = [data.draw(st.lists(VOCAB, min_size=n, max_size=n)) for _, n in spans]
        before = self._snapshot()
        try:
            step = ActiveStep(spans, native=False)
        except (CacheFull, PoolExhausted):
            assert self._snapshot() == before, "a refused step changed a cache"
            return
        layers = LAYERS if commit else data.draw(st.integers(0, LAYERS))  # an abort may come midway
        position = torch.tensor([c.length + i for c, n in spans for i in range(n)])
        for layer in range(layers):
            ks, vs = zip(*(fake_kv(range(layer, layer + 1), chunk, c.length) for (c, _), chunk in zip(spans, chunks)))
            k, v = torch.cat(ks, 2), torch.cat(vs, 2)
            step.attend(torch.zeros_like(k), k, v, position, layer, 1.0, torch.float32)
        if commit:
            step.commit()
            for (cache, _), chunk in zip(spans, chunks):
                self.ref[cache.key] += chunk
                self._publish(cache)
        else:
            step.abort()
            assert [c.length for c, _ in spans] == [len(self.ref[c.key]) for c, _ in spans]

    @rule(data=st.data())
    @precondition(lambda self: 0 < len(self.live) < 6)
    def fork(self, data):
        parent = self._pick(data)
        before = self._snapshot()
        try:
            self._adopt(parent.fork(), self.ref[parent.key])
        except PoolExhausted:
            assert parent.config.sizing is Sizing.STATIC and self._snapshot() == before

    @rule(data=st.data())
    @precondition(lambda self: any(c.length for c in self.live.values()))
    def rewind(self, data):
        cache = self._pick(data, nonempty=True)
        n = data.draw(st.integers(1, cache.length))
        cache.rewind(n)
        del self.ref[cache.key][len(self.ref[cache.key]) - n :]

    @rule(data=st.data())
    @precondition(lambda self: any(c.length for c in self.live.values()))
    def reset(self, data):
        cache = self._pick(data, nonempty=True)
        cache.reset()
        self.ref[cache.key].clear()

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def drop(self, data):
        cache = self._pick(data)
        cache.release()
        del self.live[cache.key], self.ref[cache.key]

    @rule(rows=st.integers(1, N_BLOCKS))
    def squeeze(self, rows):
        """Something else takes blocks for a moment (another cache's growth): cached prefixes are evicted."""
        taken = []
        for _ in range(rows):
            try:
                taken.append(self.pool.allocate())
            except PoolExhausted:
                break
        for block in taken:
            self.pool.release(block)

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def pool_is_consistent(self):
        self.pool.check()
        assert self.pool.mismatches == 0
        held = sum(len(c.table) for c in self.live.values())
        assert sum(self.pool.refs) == held
        assert self.pool.reserved == sum(c._reserved for c in self.live.values())
        for c in self.live.values():  # a static cache holds back no more than the rest of its capacity
            assert len(c.table) + c._reserved <= c.max_blocks if c.config.sizing is Sizing.STATIC else c._reserved == 0

    @invariant()
    def every_cache_holds_its_reference(self):
        for key, cache in self.live.items():
            tokens = self.ref[key]
            assert cache.length == len(tokens)
            assert len(cache.table) == -(-len(tokens) // B)
            for i, block in enumerate(cache.table):  # the ids each referenced block records
                row = tokens[i * B : (i + 1) * B]
                assert self.pool.tokens_of(block)[: len(row)] == row
            if tokens:  # the KV, read back through the block table
                assert all(torch.equal(got, want) for got, want in zip(read_back(self.pool, cache.table, len(tokens)),
                                                                       fake_kv(range(LAYERS), tokens, 0)))

    @invariant()
    def every_indexed_block_holds_what_its_hash_names(self):
        for digest, block in self.pool.index().items():
            prefix = self.meaning[digest]
            assert prefix_hashes(prefix, B)[-1] == digest
            assert self.pool.tokens_of(block) == list(prefix[-B:])
            got = read_back(self.pool, [block], B)
            assert all(torch.equal(g, w) for g, w in zip(got, fake_kv(range(LAYERS), list(prefix[-B:]), len(prefix) - B)))

    def teardown(self):
        for cache in self.live.values():
            cache.release()
        self.pool.check()
        assert sum(self.pool.refs) == 0 and self.pool.reserved == 0


def run_machine(examples: int, steps: int) -> None:
    run = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                   derandomize=True, suppress_health_check=list(HealthCheck))
    run(type("PoolRun", (PoolMachine,), {})).TestCase().runTest()  # a class of its own: settings bind to it


def test_the_pool_matches_its_model():
    run_machine(examples=1000, steps=40)


@pytest.mark.slow
def test_the_pool_matches_its_model_at_length():
    run_machine(examples=2500, steps=60)


def test_a_hit_whose_ids_differ_from_the_request_is_refused_and_recomputed():
    """The guard: an index entry whose block no longer holds the hashed tokens is never served."""
    pool = BlockPool(layout(), 8, block_size=B)
    tokens = [1, 2, 1, 0, 2, 2, 0, 1, 2]  # two full blocks
    first = SessionCache(layout(), pool)
    first.reserve(len(tokens))
    first.commit(len(tokens))
    first.publish(tokens)
    pool.record(first.table[1], [0, 0, 0, 0])  # as a bug would leave it: the index names other content
    first.release()
    other = SessionCache(layout(), pool)
    assert other.attach_prefix(tokens) == B  # the first block is shared, the second recomputed
    assert pool.mismatches == 1 and len(pool.index()) == 1
    again = SessionCache(layout(), pool)
    assert again.attach_prefix(tokens) == B and pool.mismatches == 1  # dropped from the index: not met again
    for cache in (other, again):
        cache.release()
    pool.check()
