"""Tenants in the scheduler, against real caches with no model: admission counts what fits, the virtual
token counter shares the steps, per-key quotas, priorities and deadlines."""
import time

import pytest

from kvcache import Sizing
from server.engine.sampling import SamplingParams
from server.engine.sequence import Sequence
from server.engine.session import owner_id
from server.errors import Overloaded, TimedOut

from .test_scheduler import make, run_step


def submit(sched, sessions, prompt_len, key, max_tokens=4, priority=0, timeout=None, session=None):
    s = session or sessions.create(2048, Sizing.DYNAMIC, persistent=False, owner=key)
    s.tokens.extend(range(1, prompt_len + 1))
    req = Sequence(s, SamplingParams(max_tokens=max_tokens, temperature=0.0), prompt_len, prompt_ids=list(s.tokens),
                   history_before=s.tokens[:-prompt_len], kept=len(s.tokens) - prompt_len, priority=priority, timeout=timeout)
    sched.add(req)
    return req


def drain(sched, steps):
    for _ in range(steps):
        batch = sched.schedule()
        if not batch:
            return
        run_step(sched, batch)


def test_a_burst_fills_the_free_running_slots_and_then_the_queue():
    sched, sessions, _ = make(max_running=2, max_queued=2)
    burst = [submit(sched, sessions, 3, None) for _ in range(4)]  # all before any step admits one
    with pytest.raises(Overloaded, match="2 running and 2 waiting|0 running and 4 waiting"):
        submit(sched, sessions, 3, None)
    assert [c.request_id for c in sched.schedule().chunks] == [r.id for r in burst[:2]]


def test_a_tenant_past_its_quota_gets_429_while_another_is_served():
    sched, sessions, _ = make(max_running=4, max_queued=8, max_running_per_key=1, max_queued_per_key=2)
    for _ in range(3):
        submit(sched, sessions, 3, "key-a")
    with pytest.raises(Overloaded, match="its limit of 1 running and 2 queued"):
        submit(sched, sessions, 3, "key-a")
    b = submit(sched, sessions, 3, "key-b")
    batch = sched.schedule()
    owners = [sched.by_id[c.request_id].session.owner for c in batch.chunks]
    # a holds its one running slot; b runs beside it at once
    assert owners == [owner_id("key-a"), owner_id("key-b")] and b in sched.running
    assert sched.tenants[owner_id("key-a")].rejected == 1 and sched.tenants[owner_id("key-b")].rejected == 0


def test_a_burst_waits_behind_another_tenants_few():
    sched, sessions, _ = make(max_running=1, max_batch_tokens=64)
    a = [submit(sched, sessions, 40, "key-a") for _ in range(5)]
    b = [submit(sched, sessions, 4, "key-b") for _ in range(2)]
    admitted = []
    for _ in range(200):
        batch = sched.schedule()
        if not batch:
            break
        admitted += [c.request_id for c in batch.chunks if c.request_id not in admitted]
        run_step(sched, batch)
    # first come, first served would run all of a's first; the counter lets b's in once a's first is served
    assert admitted == [a[0].id, b[0].id, b[1].id, *(r.id for r in a[1:])]


def test_served_tokens_follow_the_weights():
    a_key, b_key = "key-a", "key-b"
    sched, sessions, _ = make(max_running=2, max_batch_tokens=32,
                              tenant_weights=((owner_id(a_key), 2.0), (owner_id(b_key), 1.0)))
    # a sends long prompts and b short ones, both always with work queued
    for _ in range(600):
        for key, prompt in ((a_key, 60), (b_key, 6)):
            if sum(r.session.owner == owner_id(key) for r in sched.waiting) < 3:
                submit(sched, sessions, prompt, key, max_tokens=4)
        run_step(sched, sched.schedule())
    a, b = sched.tenants[owner_id(a_key)].tokens, sched.tenants[owner_id(b_key)].tokens
    assert a > 1000 and 1.8 < a / b < 2.2, (a, b)


def test_a_tenant_back_from_idle_banks_no_credit():
    sched, sessions, _ = make(max_running=1, max_batch_tokens=64)
    for _ in range(20):  # a works alone for a while; b's counter stays where it was
        submit(sched, sessions, 30, "key-a")
        drain(sched, 100)
    submit(sched, sessions, 30, "key-a")
    submit(sched, sessions, 30, "key-b")  # b arrives after its long pause, while a is busy
    a, b = sched.tenants[owner_id("key-a")], sched.tenants[owner_id("key-b")]
    # it starts level with a: it does not get a whole idle period's worth of steps in a row
    assert b.counter == a.counter > 300  # (a prompt the pool holds already costs only its new tokens)


def test_priority_orders_a_tenants_own_requests():
    sched, sessions, _ = make(max_running=1)
    low = submit(sched, sessions, 3, "key-a", priority=5)
    high = submit(sched, sessions, 3, "key-a", priority=-1)
    assert [c.request_id for c in sched.schedule().chunks] == [high.id]
    drain(sched, 50)
    assert low.finished is not None and high.finished.reason == "length"


def test_deadlines_end_a_running_request_and_refuse_a_queued_one():
    sched, sessions, _ = make(max_running=1)
    keep = sessions.create(2048, Sizing.DYNAMIC, persistent=True, owner=None)
    keep.tokens.extend([5, 6, 7])
    running = submit(sched, sessions, 3, None, max_tokens=1000, timeout=0.2)
    run_step(sched, sched.schedule())
    queued = submit(sched, sessions, 2, None, timeout=0.1, session=keep)
    assert keep.tokens == [5, 6, 7, 1, 2]
    time.sleep(0.25)
    assert not sched.schedule()  # both are past their deadlines: nothing is left to run
    assert running.finished.reason == "timeout" and running.output_ids  # its tokens so far
    assert queued.finished.reason == "error" and isinstance(queued.finished.error, TimedOut)
    assert keep.tokens == [5, 6, 7] and keep.busy is None  # the refused request left its session as it was
    assert not sched.has_work()


def test_metric_labels_are_keyed_hashes_and_bounded():
    import hashlib
    import hmac

    from server.engine.tenants import MAX_LABELS, Tenants

    tenants, other = Tenants(secret=b"s" * 32), Tenants(secret=b"t" * 32)
    labels = [tenants[owner_id(f"secret-{i}")].metric_label for i in range(MAX_LABELS + 5)]
    expected = "t-" + hmac.new(b"s" * 32, owner_id("secret-0").encode(), hashlib.sha256).hexdigest()[:12]
    assert labels[0] == expected and all("secret" not in x and owner_id("secret-0")[:8] not in x for x in labels)
    assert other.label(owner_id("secret-0")) != labels[0]  # another deployment's secret: another label
    assert len(set(labels[:MAX_LABELS])) == MAX_LABELS and set(labels[MAX_LABELS:]) == {"other"}
    assert tenants[None].label == "default"
