"""What the console reads of one tenant never shows another's: a session's history (GET /v1/sessions/{id})
and the output tokens/s in /v1/status, against a real server with two keys."""
import httpx
import pytest

from ..live_server import LiveServer

A, B = {"authorization": "Bearer key-alpha"}, {"authorization": "Bearer key-beta"}


@pytest.fixture(scope="module")
def server(tiny_model):
    with LiveServer(tiny_model, api_keys=("key-alpha", "key-beta")) as s:
        yield s


def own_tokens(url: str, headers: dict) -> int:
    return sum(httpx.get(url + "/v1/status", headers=headers).json()["tenant"]["throughput"]["tokens_per_s_by_second"])


def test_a_sessions_history_is_its_owners_only(server):
    url = server.url
    sid = httpx.post(url + "/v1/sessions", json={}, headers=A).json()["id"]
    r = httpx.post(url + "/generate", headers=A, timeout=120,
                   json={"inputs": "private ledger entry 4411", "session_id": sid, "parameters": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    assert httpx.get(f"{url}/v1/sessions/{sid}", headers=A).json()["text"].startswith("private ledger entry 4411")
    theirs, nobody = (httpx.get(f"{url}/v1/sessions/{s}", headers=B) for s in (sid, "x" * len(sid)))
    # B is told what it would be told of an id no one holds: nothing of A's text, nor that the id is taken
    assert theirs.status_code == nobody.status_code == 404
    assert theirs.json()["error"] | {"message": None} == nobody.json()["error"] | {"message": None}
    assert "ledger" not in theirs.text
    assert httpx.get(f"{url}/v1/sessions/{sid}").status_code == 401  # no key, no history


def test_a_key_holder_sees_its_own_output_tokens_per_second_only(server):
    url = server.url
    before_a, before_b = own_tokens(url, A), own_tokens(url, B)
    r = httpx.post(url + "/generate", headers=A, timeout=120,
                   json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 12, "details": True}})
    generated = r.json()["details"]["generated_tokens"]
    assert generated > 0
    assert own_tokens(url, A) == before_a + generated
    assert own_tokens(url, B) == before_b == 0
    status = httpx.get(url + "/v1/status", headers=A).json()
    assert status["steps"] is None  # the server's own rate stays the operator's
    assert status["tenant"]["throughput"]["tokens_per_s_now"] > 0
