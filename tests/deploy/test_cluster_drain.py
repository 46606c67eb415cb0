"""`kvserve cluster` stopped with SIGTERM under load: every request in flight through its front door, nginx
or the router, completes with its whole answer, and the cluster exits within --shutdown-timeout plus a
second."""
import json
import signal
import threading
import time

import httpx
import pytest

from .test_cluster_failover import MODEL, start_cluster, stop_cluster

IN_FLIGHT, MAX_TOKENS = 12, 48
TIMEOUT_S = 30  # long enough for every request to finish: the drain waits for them, then stops


def ask(url: str, i: int, started: threading.Event, out: dict) -> None:
    """One chat request, streamed or not by its number -> out[i] = (finish reason, tokens) or the error."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0, "stream": i % 2 == 0,
            "messages": [{"role": "user", "content": f"Request {i}: tell me about the number {i + 7}."}]}
    try:
        if not body["stream"]:
            started.set()  # sent: it runs on a replica from now on
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            r.raise_for_status()
            choice = r.json()
            out[i] = (choice["choices"][0]["finish_reason"], choice["usage"]["completion_tokens"])
            return
        body["stream_options"] = {"include_usage": True}
        reason, tokens = None, 0
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    out[i] = (reason, tokens)
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    reason = next((c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")), reason)
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                    started.set()
        out.setdefault(i, ("no [DONE]", tokens))
    except (httpx.HTTPError, KeyError, ValueError) as e:
        out[i] = repr(e)


@pytest.mark.slow
@pytest.mark.parametrize("front", ["nginx", "router"])
def test_sigterm_lets_every_request_in_flight_finish(front):
    flags = ("--nginx",) if front == "nginx" else ()
    proc, url, _, log = start_cluster(2, *flags, serve=("--shutdown-timeout", str(TIMEOUT_S), "--log-level", "warning"))
    out: dict = {}
    try:
        assert httpx.post(url + "/v1/chat/completions", timeout=120, json={  # warm: the first request's costs paid
            "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).status_code == 200
        events = [threading.Event() for _ in range(IN_FLIGHT)]
        threads = [threading.Thread(target=ask, args=(url, i, events[i], out)) for i in range(IN_FLIGHT)]
        for t in threads:
            t.start()
        for e in events:
            assert e.wait(120)
        time.sleep(0.3)  # the non-streamed requests reach their replicas
        assert len(out) < IN_FLIGHT  # requests are still running when the signal lands
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=TIMEOUT_S + 30) == 0
        took = time.monotonic() - sent
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            stop_cluster(proc)
    text = open(log).read()
    assert out == {i: ("length", MAX_TOKENS) for i in range(IN_FLIGHT)}, (out, text[-3000:])
    assert took <= TIMEOUT_S + 1, took
    assert "CancelledError" not in text and "killed" not in text, text[-3000:]
    with pytest.raises(httpx.TransportError):  # and the front door is closed
        httpx.get(url + "/health", timeout=5)
