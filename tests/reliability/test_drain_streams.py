"""SIGTERM with streams that outlast --shutdown-timeout: the engine ends each with the reason "shutdown", so
every dialect's stream gets its final event, the server exits cleanly, and a session's generated blocks are
on disk for the restarted server."""
import json
import signal
import threading
import time

import httpx
import pytest

from .long_tiny import NAME, long_tiny_checkpoint, serve, stop

LONG = 1800
PROMPT = "Tell me a long story."


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smollm):
    return long_tiny_checkpoint(tmp_path_factory.mktemp("long_tiny"), smollm.tokenizer)


def streams(sid: str) -> dict[str, tuple[str, dict, dict]]:
    """One long stream per dialect: (path, body, headers). TGI's continues a persistent session."""
    chat = [{"role": "user", "content": PROMPT}]
    return {
        "openai": ("/v1/chat/completions", {"model": NAME, "messages": chat, "stream": True, "max_tokens": LONG,
                                            "ignore_eos": True}, {}),
        "responses": ("/v1/responses", {"model": NAME, "input": PROMPT, "stream": True, "max_output_tokens": LONG}, {}),
        "anthropic": ("/v1/messages", {"model": NAME, "messages": chat, "stream": True, "max_tokens": LONG}, {}),
        "ollama": ("/api/generate", {"model": NAME, "prompt": PROMPT, "options": {"num_predict": LONG}}, {}),
        "tgi": ("/generate_stream", {"inputs": PROMPT, "parameters": {"max_new_tokens": LONG}}, {"X-Session-Id": sid}),
    }


def read(url: str, path: str, body: dict, headers: dict, started: threading.Event, lines: list[str]) -> None:
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=120) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if len(lines) >= 3:
                    started.set()


def payloads(lines: list[str]) -> list[dict]:
    out = []
    for line in lines:
        data = line[6:] if line.startswith("data: ") else line if line.startswith("{") else None
        if data is not None and data != "[DONE]":
            out.append(json.loads(data))
    return out


def test_sigterm_ends_every_stream_with_its_final_event(tmp_path, long_tiny):
    store = tmp_path / "store"
    proc, url = serve(long_tiny, store, "--shutdown-timeout", "1")
    got: dict[str, list[str]] = {}
    try:
        sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
        threads, events = [], []
        for name, (path, body, headers) in streams(sid).items():
            got[name], started = [], threading.Event()
            threads.append(threading.Thread(target=read, args=(url, path, body, headers, started, got[name])))
            events.append(started)
            threads[-1].start()
        for started in events:
            assert started.wait(60)
        sent = time.monotonic()
        out = stop(proc, signal.SIGTERM, timeout=60)
        took = time.monotonic() - sent
        for t in threads:
            t.join(30)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert took < 15, took
    assert "Traceback" not in out and "CancelledError" not in out, out[-3000:]

    chat = payloads(got["openai"])
    assert got["openai"][-1] == "data: [DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chat if c["choices"]][-1] == "abort"
    response = payloads(got["responses"])[-1]
    assert response["type"] == "response.incomplete"
    assert response["response"]["incomplete_details"] == {"reason": "server_shutdown"}
    anthropic = payloads(got["anthropic"])
    assert [e["type"] for e in anthropic[-2:]] == ["message_delta", "message_stop"]
    assert anthropic[-2]["delta"]["stop_reason"] == "pause_turn"
    ollama = payloads(got["ollama"])[-1]
    assert ollama["done"] is True and ollama["done_reason"] == "abort"
    tgi = payloads(got["tgi"])
    assert tgi[-1]["details"]["finish_reason"] == "abort"
    generated = tgi[-1]["details"]["generated_tokens"]
    assert generated > 0

    # the session that was streaming continues after a restart, its blocks read back from disk
    proc, url = serve(long_tiny, store)
    try:
        length = httpx.get(f"{url}/v1/sessions/{sid}").json()["length"]
        assert length >= generated
        r = httpx.post(url + "/generate", json={"inputs": " And then?", "parameters": {"max_new_tokens": 2}},
                       headers={"X-Session-Id": sid}, timeout=120)
        assert r.status_code == 200, r.text
        hits = httpx.get(url + "/metrics").text
        blocks = sum(float(line.rsplit(" ", 1)[1]) for line in hits.splitlines()
                     if line.startswith("kvserve:kv_disk_hits_total"))
        assert blocks * 16 >= length - 16, (blocks, length)
    finally:
        stop(proc, signal.SIGTERM)
