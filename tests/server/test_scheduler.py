"""The scheduler against real caches, with no model: rule 6's contract."""
import pytest

from kvcache import CacheConfig, CacheRegistry, Sizing
from kvcache.step import ActiveStep
from server.config import EngineConfig
from server.errors import Overloaded
from server.engine.kv_pool import KVPool
from server.engine.sampling import Sampled, SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Finished, Sequence
from server.engine.session import SessionStore

LAYOUT = CacheConfig(n_layers=2, n_kv_heads=1, head_dim=4, capacity=1)  # 64 bytes per token
EOS = 0


def make(budget_tokens=10_000, **kw):
    config = EngineConfig(kv_budget=budget_tokens * LAYOUT.bytes_per_token(), **kw).for_model(experts=0)
    registry = CacheRegistry()
    pool = KVPool(registry, config.kv_budget, LAYOUT)
    sessions = SessionStore(100)
    return Scheduler(config, pool, sessions, frozenset({EOS})), sessions, registry


def submit(sched, sessions, prompt_len, max_tokens=4, session=None, capacity=64, sizing=Sizing.DYNAMIC):
    s = session or sessions.create(capacity, sizing, persistent=session is not None, owner=None)
    s.tokens.extend(range(1, prompt_len + 1))
    req = Sequence(s, SamplingParams(max_tokens=max_tokens, temperature=0.0), prompt_len, prompt_ids=list(s.tokens))
    sched.add(req)
    return req


def run_step(sched, batch, token=7):
    """What the runner does to the caches, then the sampled tokens."""
    step = ActiveStep([(c.cache, len(c.tokens)) for c in batch.chunks])
    for c, start in zip(batch.chunks, step.lengths):
        assert start == c.start and c.cache is sched.by_id[c.request_id].session.cache
    step._next_layer = step.n_layers  # no model: every layer "ran"
    step.commit()
    sched.postprocess(batch, [Sampled(token) for c in batch.chunks if c.sample])


def test_chunked_prefill_shares_the_token_budget_with_decodes():
    sched, sessions, _ = make(max_batch_tokens=8)
    a = submit(sched, sessions, 3)
    b1 = sched.schedule()
    assert [(len(c.tokens), c.sample) for c in b1.chunks] == [(3, True)]
    run_step(sched, b1)
    b = submit(sched, sessions, 20)
    steps = []
    for _ in range(3):
        batch = sched.schedule()
        steps.append([(c.request_id, len(c.tokens), c.sample) for c in batch.chunks])
        run_step(sched, batch)
    # a decodes one token every step; b's prompt fills the rest of the budget in chunks of 7
    assert steps[0] == [(a.id, 1, True), (b.id, 7, False)]
    assert steps[1] == [(a.id, 1, True), (b.id, 7, False)]
    assert steps[2] == [(a.id, 1, True), (b.id, 6, True)]
    assert a.finished is not None and a.finished.reason == "length" and len(a.output_ids) == 4
    assert b.session.cached_length == 20 and b.output_ids == [7]


def test_prefill_beside_decodes_takes_at_most_its_share_and_all_the_budget_alone():
    sched, sessions, _ = make(max_batch_tokens=16, mixed_prefill_tokens=5)
    alone = submit(sched, sessions, 30, max_tokens=8)
    first = sched.schedule()
    assert [len(c.tokens) for c in first.chunks] == [16]  # nobody decodes: the whole budget
    run_step(sched, first)
    run_step(sched, sched.schedule())  # the prompt's last 14 tokens; it decodes from now on
    late, later = submit(sched, sessions, 12), submit(sched, sessions, 3)
    steps = []
    for _ in range(3):
        batch = sched.schedule()
        steps.append([(c.request_id, len(c.tokens)) for c in batch.chunks])
        run_step(sched, batch)
    # beside the decode, 5 prefill tokens a step across both newcomers, though the budget leaves 15
    assert steps == [[(alone.id, 1), (late.id, 5)], [(alone.id, 1), (late.id, 5)],
                     [(alone.id, 1), (late.id, 2), (later.id, 3)]]
    with pytest.raises(ValueError, match="mixed_prefill_tokens"):
        EngineConfig(mixed_prefill_tokens=0)


def test_running_limit_queue_limit_and_fcfs():
    sched, sessions, _ = make(max_running=2, max_queued=2)
    reqs = [submit(sched, sessions, 2) for _ in range(2)]
    batch = sched.schedule()
    assert {c.request_id for c in batch.chunks} == {r.id for r in reqs}
    late = [submit(sched, sessions, 2) for _ in range(2)]
    with pytest.raises(Overloaded):
        submit(sched, sessions, 2)
    run_step(sched, batch)
    assert [c.request_id for c in sched.schedule().chunks] == [r.id for r in reqs]
    assert list(sched.waiting) == late


def test_cancelled_requests_are_reaped_and_temporary_sessions_removed():
    sched, sessions, registry = make()
    req = submit(sched, sessions, 5, max_tokens=50)
    run_step(sched, sched.schedule())
    assert req.session.id in registry
    req.cancelled = True
    assert not sched.schedule()
    assert req.finished.reason == "cancelled"
    assert len(sessions) == 0 and len(registry) == 0
    events = []
    while not req.events.empty():
        events.append(req.events.get_nowait())
    assert isinstance(events[-1], Finished)


def test_idle_sessions_are_evicted_lru_and_keep_their_history():
    sched, sessions, registry = make(budget_tokens=2 * 32)
    persistent = [sessions.create(32, Sizing.STATIC, True, None) for _ in range(3)]
    for s in persistent[:2]:
        req = submit(sched, sessions, 4, max_tokens=1, session=s)
        run_step(sched, sched.schedule())
        assert req.finished is not None
    assert all(s.cache is not None for s in persistent[:2])
    req = submit(sched, sessions, 4, max_tokens=1, session=persistent[2])
    run_step(sched, sched.schedule())
    assert persistent[0].cache is None and persistent[0].id not in registry  # least recently used
    assert persistent[1].cache is not None and persistent[2].cache is not None
    assert persistent[0].tokens == [1, 2, 3, 4, 7] and persistent[0].pending == [1, 2, 3, 4, 7]
    assert sched.pool.used() <= sched.pool.budget


def test_preemption_recomputes_youngest_and_nobody_starves():
    # two dynamic sessions start at 16 slots each and grow to 32; there is room for 40 in all,
    # so the older one's growth preempts the younger, which later recomputes its KV
    sched, sessions, _ = make(budget_tokens=40, max_batch_tokens=64)
    old = submit(sched, sessions, 14, max_tokens=18)
    young = submit(sched, sessions, 14, max_tokens=18)
    preempted = False
    for _ in range(200):
        batch = sched.schedule()
        if not batch:
            break
        run_step(sched, batch)
        preempted |= young in sched.waiting
        assert sched.pool.used() <= sched.pool.budget
    assert preempted
    assert old.finished.reason == "length" and young.finished.reason == "length"
    assert old.finished is not None and sched.counts.preemptions >= 1
    assert len(old.output_ids) == len(young.output_ids) == 18


def test_waiting_requests_whose_sessions_hold_every_block_still_run():
    # two idle sessions fill the pool; each then waits with a new turn that needs one more block, and
    # nothing runs that could give one back: the last in the queue gives up its KV for the first
    sched, sessions, _ = make(budget_tokens=64)  # 4 blocks of 16 tokens
    first, second = sessions.create(64, Sizing.DYNAMIC, True, None), sessions.create(64, Sizing.DYNAMIC, True, None)
    for s, start in ((first, 100), (second, 200)):
        s.tokens.extend(range(start, start + 32))
        req = Sequence(s, SamplingParams(max_tokens=1, temperature=0.0), 32, prompt_ids=list(s.tokens))
        sched.add(req)
        run_step(sched, sched.schedule())
        assert req.finished is not None and s.cache.length == 32
    assert sched.pool.blocks.available() == 0
    older, younger = submit(sched, sessions, 4, max_tokens=2, session=first), submit(sched, sessions, 4, max_tokens=2, session=second)
    batch = sched.schedule()
    assert [(c.request_id, c.start, len(c.tokens)) for c in batch.chunks] == [(older.id, 32, 5)]
    assert second.cache is None and second.tokens[:33] == [*range(200, 232), 7]  # its history stays
    assert sched.counts.evictions == 1
    for _ in range(20):
        if not sched.has_work():
            break
        run_step(sched, sched.schedule())
    assert older.finished.reason == younger.finished.reason == "length"
    assert second.tokens == [*range(200, 232), 7, 1, 2, 3, 4, 7, 7] and second.busy is None


def test_eos_finishes_and_failed_step_rolls_back():
    sched, sessions, _ = make()
    req = submit(sched, sessions, 3, max_tokens=10)
    run_step(sched, sched.schedule(), token=EOS)
    assert req.finished.reason == "eos"
    s = sessions.create(64, Sizing.DYNAMIC, True, None)
    req = submit(sched, sessions, 3, max_tokens=10, session=s)
    run_step(sched, sched.schedule())
    batch = sched.schedule()
    for c in batch.chunks:  # the forward wrote and committed, then the step failed
        s.cache.reserve(len(c.tokens))
        s.cache.commit(len(c.tokens))
    sched.fail_step(batch, RuntimeError("boom"))
    assert s.tokens == [] and s.cache.length == 0 and req.finished.reason == "error"
    assert s.busy is None


def test_a_stop_found_downstream_cuts_the_reply_and_the_session_history():
    sched, sessions, _ = make()
    s = sessions.create(64, Sizing.DYNAMIC, True, None)
    req = submit(sched, sessions, 3, max_tokens=10, session=s)
    for token in (11, 12, 13):
        run_step(sched, sched.schedule(), token=token)
    # the output stream saw a stop string end at the 2nd token, while a 3rd was already sampled
    sched.stop(req, 2)
    assert req.finished.reason == "stop" and req.finished.completion_tokens == 2
    assert s.tokens == [1, 2, 3, 11, 12] and s.cache.length <= 5 and s.busy is None
    assert not sched.has_work()


def test_a_stop_found_while_its_step_runs_ends_it_once_the_step_has_written():
    sched, sessions, _ = make()
    s = sessions.create(64, Sizing.DYNAMIC, True, None)
    req = submit(sched, sessions, 3, max_tokens=10, session=s)
    for token in (11, 12):
        run_step(sched, sched.schedule(), token=token)
    batch = sched.schedule()  # the decode of 12 is in flight
    sched.stop(req, 1)  # the output stream saw a stop string end at the 1st token
    assert req.finished is None and s.tokens == [1, 2, 3, 11, 12]  # nothing moves under a running step
    run_step(sched, batch, token=13)
    assert req.finished.reason == "stop" and req.finished.completion_tokens == 1 and req.output_ids == [11]
    assert s.tokens == [1, 2, 3, 11] and s.cache.length <= 4 and s.busy is None
    assert not sched.has_work()
