import subprocess
import sys
import time

import httpx
import pytest

from models import load_model
from server.config import EngineConfig

from ..live_server import LiveServer


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["llama"]))


@pytest.fixture(scope="module")
def tiny_server(tiny_model):
    with LiveServer(tiny_model, EngineConfig(session_capacity=64, max_stop_strings=4), name="tiny") as server:
        yield server


@pytest.fixture(scope="module")
def short_server(tiny_model):
    """The tiny model served with --max-model-len 48: every reply the fuzzer asks for stays short."""
    with LiveServer(tiny_model, EngineConfig(max_model_len=48, max_stop_strings=4), name="tiny") as server:
        yield server


def error_of(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body["error"]) >= {"message", "type", "param"}
    return body["error"]


CASES = [
    # (path, raw body or json, expected status, words the message must name)
    ("/generate", b'{"inputs": "hi", ', 400, "JSON"),
    ("/generate", {"inputs": 12}, 400, "inputs"),
    ("/generate", {"parameters": {}}, 400, "inputs"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": -1}}, 400, "max_new_tokens"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 10**9}}, 400, "max_new_tokens"),
    ("/generate", {"inputs": "hi", "parameters": {"max_new_tokens": 600}}, 400, "context"),  # past the model's 512
    ("/generate", {"inputs": "hi", "parameters": {"temperature": -1}}, 400, "temperature"),
    ("/generate", {"inputs": "hi", "parameters": {"stop": ["a", "b", "c", "d", "e"]}}, 400, "stop"),
    ("/generate", {"inputs": ""}, 400, "empty"),
    ("/generate", {"inputs": "word " * 600}, 400, "capacity"),
    ("/generate", {"inputs": "hi", "session_id": "nope"}, 404, "nope"),
    ("/v1/completions", {"prompt": [1, 2, 10**8], "max_tokens": 2}, 400, "vocabulary"),
    ("/v1/completions", {"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 9}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("/v1/sessions", {"capacity": -5}, 400, "capacity"),
    ("/v1/sessions", {"sizing": "huge"}, 400, "sizing"),
    ("/generate", b'{"inputs": "\xff\xfe bad utf-8"}', 400, ""),
]


@pytest.mark.parametrize("path,body,status,word", CASES)
def test_bad_requests_get_clear_errors(tiny_server, path, body, status, word):
    url = tiny_server.url
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    err = error_of(httpx.post(url + path, **kw), status)
    assert word.lower() in err["message"].lower() + str(err["param"]).lower()
    assert httpx.get(url + "/health").status_code == 200


def test_body_limit_busy_session_and_unknown_session(tiny_server):
    url = tiny_server.url
    error_of(httpx.post(url + "/generate", json={"inputs": "x" * (5 * 2**20)}), 413)
    error_of(httpx.get(url + "/v1/sessions/unknown"), 404)
    error_of(httpx.delete(url + "/v1/sessions/unknown"), 404)
    sid = httpx.post(url + "/v1/sessions", json={"capacity": 512}).json()["id"]
    body = {"prompt": "go", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers={"X-Session-Id": sid}) as r:
        lines = r.iter_lines()  # kept alive: dropping the iterator closes the connection (a disconnect)
        assert r.status_code == 200, next(lines)
        error_of(httpx.delete(f"{url}/v1/sessions/{sid}"), 409)
        error_of(httpx.post(url + "/generate", json={"inputs": "x", "session_id": sid}), 409)
    assert httpx.get(url + "/health").status_code == 200


def test_max_model_len_bounds_every_sequence(short_server):
    url = short_server.url
    assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 48
    error_of(httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 60}), 400)
    error_of(httpx.post(url + "/v1/sessions", json={"capacity": 49}), 400)
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi there", "ignore_eos": True}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["total_tokens"] == 48


def test_schemathesis_finds_no_server_errors(short_server, tmp_path):
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", short_server.url + "/openapi.json",
           "--checks", "not_a_server_error,response_schema_conformance", "--max-examples", "15",
           "--seed", "1", "--workers", "1", "--request-timeout", "60",
           "--phases", "examples,coverage,fuzzing"]  # no --max-time: with one, fuzzing runs until it is spent
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert httpx.get(short_server.url + "/health").status_code == 200


def test_api_keys_and_session_ownership(tiny_model):
    with LiveServer(tiny_model, api_keys=("key-a", "key-b"), name="tiny") as server:
        url = server.url
        assert httpx.get(url + "/health").status_code == 200  # public
        error_of(httpx.post(url + "/v1/sessions", json={}), 401)
        error_of(httpx.post(url + "/v1/sessions", json={}, headers={"Authorization": "Bearer wrong"}), 401)
        error_of(httpx.get(url + "/v1/models"), 401)
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        sid = httpx.post(url + "/v1/sessions", json={}, headers=a).json()["id"]
        assert len(sid) >= 22
        assert httpx.get(f"{url}/v1/sessions/{sid}", headers=a).status_code == 200
        error_of(httpx.get(f"{url}/v1/sessions/{sid}", headers=b), 404)
        error_of(httpx.post(url + "/generate", json={"inputs": "x", "session_id": sid}, headers=b), 404)
        error_of(httpx.delete(f"{url}/v1/sessions/{sid}", headers=b), 404)
        assert httpx.post(url + "/generate", json={"inputs": "x", "session_id": sid, "parameters": {"max_new_tokens": 2}},
                          headers=a).status_code == 200


def test_non_streaming_client_that_leaves_is_cancelled(tiny_server):
    url, engine = tiny_server.url, tiny_server.engine
    sid = httpx.post(url + "/v1/sessions", json={"capacity": 512}).json()["id"]
    body = {"prompt": "go", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, headers={"X-Session-Id": sid}, timeout=0.3)
    session = engine.sessions.get(sid, None)
    started = session.info()["length"]
    deadline = time.time() + 3
    while time.time() < deadline and session.busy is not None:
        time.sleep(0.05)
    assert session.busy is None, "the abandoned request kept running"
    assert session.info()["length"] < started + 400  # stopped long before its 500 tokens
    assert not engine.scheduler.has_work()
