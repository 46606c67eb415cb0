"""The live view's throughput (RecentSteps): tokens a second now and over the minute, the server's and each
tenant's own, on a clock the test moves."""
import pytest

from server.engine import metrics
from server.engine.metrics import RecentSteps


@pytest.fixture
def clock(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: now[0])
    return now


def test_now_is_the_last_seconds_and_the_minute_is_the_mean(clock):
    recent = RecentSteps()
    clock[0] = 950.0
    recent.record(1, 10, 600, {"a": 600})  # a burst long ago
    for second in range(5):  # the last five seconds: 100 tokens each, a's 40 and b's 60
        clock[0] = 995.5 + second
        recent.record(2, 2, 100, {"a": 40, "b": 60})
    clock[0] = 1000.0
    s = recent.summary()
    assert s["tokens_per_s_now"] == 100.0 and s["now_window_s"] == 5
    assert s["tokens_per_s_last_minute"] == round(1100 / 60, 2)
    assert sum(s["tokens_per_s_by_second"]) == 1100 and s["tokens_per_s_by_second"][-5:] == [100] * 5
    assert (s["last_step_sessions"], s["last_step_tokens"]) == (2, 2)
    a, b = recent.throughput("a"), recent.throughput("b")
    assert (a["tokens_per_s_now"], a["tokens_per_s_last_minute"]) == (40.0, round(800 / 60, 2))
    assert (b["tokens_per_s_now"], sum(b["tokens_per_s_by_second"])) == (60.0, 300)
    assert sum(recent.throughput(None)["tokens_per_s_by_second"]) == 0  # no one else's tokens


def test_steps_past_the_minute_are_forgotten(clock):
    recent = RecentSteps()
    recent.record(1, 1, 50, {None: 50})
    clock[0] += 61
    recent.record(1, 1, 0, {})
    assert recent.summary()["tokens_per_s_by_second"] == [0] * 60
    assert recent.throughput(None)["tokens_per_s_last_minute"] == 0
