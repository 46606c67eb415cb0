"""Every error a client gets from `kvserve cluster --nginx` is JSON in its dialect's shape, with no internal
address: here the router's own ("Backend request failed: ... http://127.0.0.1:PORT/v1/responses", as
text), when the one replica dies under requests of each dialect."""
import os
import signal
import threading
import time

import httpx
import pytest

from ..reliability.long_tiny import NAME, long_tiny_checkpoint
from .test_cluster_failover import start_cluster, stop_cluster

LONG = 1800  # tokens: the random model rarely samples EOS, so each request runs until the replica dies


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smollm):
    return long_tiny_checkpoint(tmp_path_factory.mktemp("long_tiny"), smollm.tokenizer)


REQUESTS = {  # dialect: (path, body), none with a session: the router sends each
    "responses": ("/v1/responses", {"model": NAME, "input": "Tell me a long story.", "max_output_tokens": LONG}),
    "anthropic": ("/v1/messages", {"model": NAME, "max_tokens": LONG,
                                   "messages": [{"role": "user", "content": "Tell me a long story."}]}),
    "ollama": ("/api/generate", {"model": NAME, "prompt": "Tell me a long story.", "stream": False,
                                 "options": {"num_predict": LONG}}),
    "openai": ("/v1/chat/completions", {"model": NAME, "max_tokens": LONG, "ignore_eos": True,
                                        "messages": [{"role": "user", "content": "Tell me a long story."}]}),
}


def in_its_shape(dialect: str, r: httpx.Response) -> str:
    """The error's message, once its shape is the dialect's, as one kvserve server answers it."""
    assert r.status_code >= 500 and r.headers["content-type"].startswith("application/json"), (r.status_code, r.text)
    assert "127.0.0.1" not in r.text and "Backend request failed" not in r.text, r.text
    body = r.json()
    if dialect == "anthropic":
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        return body["error"]["message"]
    if dialect == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert dialect == "responses" or body["error"]["code"] == r.status_code, body
    return body["error"]["message"]


@pytest.mark.slow
def test_a_replica_dying_under_requests_gives_json_errors_in_each_dialect(long_tiny):
    proc, url, pids, _ = start_cluster(1, "--nginx", "--model", str(long_tiny), "--policy", "round_robin",
                                       serve=("--served-model-name", NAME))
    answers: dict[str, httpx.Response] = {}

    def send(dialect: str) -> None:
        path, body = REQUESTS[dialect]
        answers[dialect] = httpx.post(url + path, json=body, timeout=120)

    try:
        threads = [threading.Thread(target=send, args=(d,)) for d in REQUESTS]
        for t in threads:
            t.start()
        replica = next(iter(pids))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # all four on the replica
            if httpx.get(replica + "/get_load", timeout=10).json()["load"] == len(REQUESTS):
                break
            time.sleep(0.2)
        assert not answers, {d: r.text[:200] for d, r in answers.items()}  # none has finished by itself
        os.kill(pids[replica], signal.SIGKILL)
        for t in threads:
            t.join(90)
        assert set(answers) == set(REQUESTS)
        for dialect, r in answers.items():
            in_its_shape(dialect, r)
    finally:
        stop_cluster(proc)
