"""Two `kvserve serve` processes on one --kv-disk, each the other's --peers: a request for a session or a
stored response that the other holds is relayed to it and answered there, in every route that names one,
streamed too; and after a restart, sessions wait on disk and go to whichever server is asked first."""
import json
import re
import signal

import httpx
import pytest

from server.api.peers import FORWARDED

from ..live_server import free_port, metric, start_cli_server, wait_healthy

KEY, OTHER = {"authorization": "Bearer peer-key-a"}, {"authorization": "Bearer peer-key-b"}
ADMIN = {"authorization": "Bearer peer-admin"}
TURN = {"parameters": {"max_new_tokens": 4, "details": True}}


@pytest.fixture
def pair(tmp_path, tiny_checkpoints):
    """-> start(): two servers on tmp_path/store, each the other's peer, started again on each call."""
    model, store = str(tiny_checkpoints["llama"]), str(tmp_path / "store")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    running: list = []

    def start() -> list[str]:
        stop_all()
        for port in ports:
            running.append(start_cli_server(["--model", model, "--served-model-name", "tiny", "--kv-disk", store,
                                             "--api-key", "peer-key-a", "--api-key", "peer-key-b", "--admin-key", "peer-admin",
                                             "--peers", ",".join(urls)], port))
        for url, proc in zip(urls, running):
            wait_healthy(url, timeout=300, proc=proc)
        return urls

    def stop_all() -> list[str]:
        outs = []
        for proc in running:
            proc.send_signal(signal.SIGTERM)
            outs.append(proc.communicate(timeout=120)[0])
        running.clear()
        return outs

    start.stop, start.store = stop_all, tmp_path / "store"
    yield start
    stop_all()


def held(url: str, sid: str, headers=KEY) -> bool:
    """Whether `url` holds the session in RAM (a server's list names only its own)."""
    return any(s["id"] == sid for s in httpx.get(url + "/v1/sessions", headers=headers, timeout=30).json()["data"])


def generate(url: str, sid: str, text: str, headers=KEY) -> httpx.Response:
    return httpx.post(url + "/generate", json={"inputs": text, **TURN}, timeout=120,
                      headers={**headers, "X-Session-Id": sid})


def test_a_request_for_a_session_the_peer_holds_is_answered_by_it(pair):
    a, b = pair()
    sid = "peer-session-" + "x" * 16
    assert httpx.post(a + "/v1/sessions", headers={**KEY, "X-Session-Id": sid}, json={}).status_code == 200
    assert generate(a, sid, "word " * 40).status_code == 200
    length = httpx.get(f"{a}/v1/sessions/{sid}", headers=KEY).json()["length"]

    # through b: relayed to a, which runs it on the KV it holds
    r = generate(b, sid, " and more")
    assert r.status_code == 200, r.text
    assert httpx.get(f"{b}/v1/sessions/{sid}", headers=KEY).json()["length"] > length  # b's answer is a's
    assert held(a, sid) and not held(b, sid)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", b + "/v1/chat/completions", json=chat, headers={**KEY, "X-Session-Id": sid}, timeout=120) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and any('"finish_reason": "length"' in line for line in lines)
    fork = httpx.post(f"{b}/v1/sessions/{sid}/fork", headers=KEY, json={}, timeout=60)
    assert fork.status_code == 200 and held(a, fork.json()["id"])  # made where its parent's blocks are

    # another key's request for it is no request for a held session: 404 on either server
    assert httpx.get(f"{b}/v1/sessions/{sid}", headers=OTHER).status_code == 404
    assert generate(b, sid, "x", headers=OTHER).status_code == 404
    # a relayed request is never relayed again: the loop guard answers the 409 itself
    looped = httpx.get(f"{b}/v1/sessions/{sid}", headers={**KEY, FORWARDED: "1"})
    assert looped.status_code == 409 and "another server" in looped.json()["error"]["message"]
    assert httpx.delete(f"{b}/v1/sessions/{sid}", headers=KEY).status_code == 200
    assert not held(a, sid) and httpx.get(f"{a}/v1/sessions/{sid}", headers=KEY).status_code == 404

    # a lock file names its holder in a folder others may write in: a name no peer answers to is a 409
    [lock] = pair.store.glob(f"*/sessions/*.{fork.json()['id']}.lock")
    lock.write_text("f" * 32)
    planted = httpx.get(f"{b}/v1/sessions/{fork.json()['id']}", headers=KEY)
    assert planted.status_code == 409 and planted.headers["retry-after"] == "1"


def events(r: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def test_a_responses_chain_continues_wherever_each_turn_lands(pair):
    a, b = pair()
    first = httpx.post(a + "/v1/responses", headers=KEY, timeout=120,
                       json={"model": "tiny", "input": "Tell me about rivers. " * 8, "max_output_tokens": 4}).json()
    previous, hosts = first["id"], [a, b, b, a]
    for i, url in enumerate(hosts):  # turns alternate servers, as a router may send them
        body = {"model": "tiny", "input": f"Go on, part {i}.", "max_output_tokens": 4, "previous_response_id": previous,
                "stream": i % 2 == 1}
        if body["stream"]:
            with httpx.stream("POST", url + "/v1/responses", json=body, headers=KEY, timeout=120) as r:
                assert r.status_code == 200
                done = [e for e in events(r) if e["type"] in ("response.completed", "response.incomplete")]
            response = done[-1]["response"]
        else:
            r = httpx.post(url + "/v1/responses", json=body, headers=KEY, timeout=120)
            assert r.status_code == 200, r.text
            response = r.json()
        assert response["previous_response_id"] == previous and response["usage"]["input_tokens_details"]["cached_tokens"] > 0
        previous = response["id"]
        assert held(a, previous) and not held(b, previous)  # the chain stays where its KV is
    assert httpx.get(f"{b}/v1/responses/{previous}", headers=KEY).json()["id"] == previous
    items = httpx.get(f"{b}/v1/responses/{previous}/input_items", headers=KEY).json()
    assert items["data"][0]["content"][0]["text"] == "Go on, part 3."
    assert httpx.get(f"{b}/v1/responses/{previous}", headers=OTHER).status_code == 404
    assert httpx.delete(f"{b}/v1/responses/{previous}", headers=KEY).json()["deleted"] is True
    assert httpx.get(f"{a}/v1/responses/{previous}", headers=KEY).status_code == 404


def test_after_a_restart_each_session_goes_to_the_first_server_asked(pair):
    a, b = pair()
    sids = [f"restart-session-{i}-" + "y" * 12 for i in range(4)]
    for i, sid in enumerate(sids):
        assert httpx.post(a + "/v1/sessions", headers={**KEY, "X-Session-Id": sid}, json={}).status_code == 200
        assert generate(a, sid, f"Session {i}: " + "tell me more " * 20).status_code == 200
    lengths = {sid: httpx.get(f"{a}/v1/sessions/{sid}", headers=KEY).json()["length"] for sid in sids}
    outs = pair.stop()
    assert all("Traceback" not in out for out in outs), outs

    a, b = pair()
    for i, sid in enumerate(sids):  # half asked first on each server: each takes up its own, none is refused
        first, second = (a, b) if i % 2 else (b, a)
        hits = metric(first, "kvserve:kv_disk_hits_total", ADMIN)
        r = generate(first, sid, " once more")
        assert r.status_code == 200, r.text
        read = metric(first, "kvserve:kv_disk_hits_total", ADMIN) - hits
        assert read >= lengths[sid] // 16, (read, lengths[sid])  # every full block of its history, from disk
        assert held(first, sid) and not held(second, sid)
        assert generate(second, sid, " and again").status_code == 200  # relayed to the one that took it
        assert httpx.get(f"{second}/v1/sessions/{sid}", headers=KEY).json()["length"] > lengths[sid] + 2
    outs = pair.stop()
    for out in outs:  # nothing was taken at start: every session waited for its first request
        assert re.search(r"0 sessions restored, 4 sessions left on disk", out), out[-2000:]
        assert "Traceback" not in out
