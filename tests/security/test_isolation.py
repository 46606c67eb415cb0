"""Tenants who cannot see each other, attacked as a hostile tenant would, against a real server with two
keys, an operator's key and a disk tier: the prefix cache, ids, the operator's figures and bodies too
large. Each attack fails, and the legitimate use beside it still works."""
import hashlib
import statistics
import uuid

import httpx
import pytest

from server.config import EngineConfig, ServerConfig

from ..live_server import LiveServer

A, B = {"authorization": "Bearer key-alpha"}, {"authorization": "Bearer key-beta"}
OPS = {"authorization": "Bearer key-ops"}
MODEL = "smollm2-135m-instruct"


def memo() -> str:
    """A private memo of a fixed shape, never sent before: about 180 tokens."""
    tag = uuid.uuid4().hex
    lines = [f"Item {i}: account {tag[i % 32:]}{i * 7919} owes {i * 37} credits to ledger {tag[:8]}-{i}." for i in range(12)]
    return "Confidential memo.\n" + "\n".join(lines)


def chat_cached(url: str, headers: dict, text: str, **extra) -> int:
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}], **extra}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def ollama_prefill_ns(url: str, headers: dict, text: str) -> int:
    """The server's own measure of a prompt's prefill (Ollama's prompt_eval_duration)."""
    body = {"model": MODEL, "prompt": text, "raw": True, "stream": False, "options": {"num_predict": 1}}
    r = httpx.post(url + "/api/generate", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["prompt_eval_duration"]


@pytest.fixture(scope="module")
def server(served_model, tmp_path_factory):
    config = EngineConfig(kv_disk=str(tmp_path_factory.mktemp("kv")))
    server_config = ServerConfig(model_name=MODEL, admin_key="key-ops", max_body_bytes=64 * 1024)
    with LiveServer(served_model, config, api_keys=("key-alpha", "key-beta"), server_config=server_config) as s:
        yield s


def test_another_tenant_neither_hits_nor_times_a_cached_prompt(server):
    url = server.url
    chat_cached(url, B, memo())  # B's own cache holds the template and a memo's fixed start, as a stranger's would
    secret, stranger = memo(), memo()
    chat_cached(url, A, secret)
    assert chat_cached(url, A, secret) >= 160  # A's own cache hits
    assert chat_cached(url, B, secret) == chat_cached(url, B, stranger)  # B learns nothing of A's memo
    # timing, as the server measures it: the prefill of A's memo costs B what a stranger's costs
    on_a, fresh = [], []
    for _ in range(3):
        text = memo()
        ollama_prefill_ns(url, A, text)
        on_a.append(ollama_prefill_ns(url, B, text))
        fresh.append(ollama_prefill_ns(url, B, memo()))
        assert ollama_prefill_ns(url, A, text) < on_a[-1]  # A's own repeat hits (its control)
    assert statistics.median(on_a) > 0.6 * statistics.median(fresh), (on_a, fresh)


def test_a_cache_salt_is_a_namespace_within_the_tenant(server):
    url, text = server.url, memo()
    chat_cached(url, A, text)
    assert chat_cached(url, A, text) >= 160
    assert chat_cached(url, A, text, cache_salt="user-1") < 160  # the salted namespace holds none of it
    assert chat_cached(url, A, text, cache_salt="user-1") >= 160  # the same salt hits
    assert chat_cached(url, B, text, cache_salt="user-1") < 160  # another tenant's same salt does not


def test_the_prefix_cache_is_shared_only_when_the_operator_says_so(served_model):
    config = EngineConfig(shared_prefix_cache=True)
    with LiveServer(served_model, config, api_keys=("key-alpha", "key-beta"), name=MODEL) as shared:
        text = memo()
        chat_cached(shared.url, A, text)
        assert chat_cached(shared.url, B, text) >= 160


def test_ids_are_private_to_their_tenant(server):
    url = server.url
    chosen = "shared-name-" + uuid.uuid4().hex
    a = httpx.post(url + "/v1/sessions", json={"id": chosen}, headers=A)
    assert a.status_code == 200
    turn = {"inputs": "Hello there", "session_id": chosen, "parameters": {"max_new_tokens": 3}}
    assert httpx.post(url + "/generate", json=turn, headers=A).status_code == 200
    # B asks for the same id: a session of its own, with nothing of A's, and no answer tells it A has one
    b = httpx.post(url + "/v1/sessions", json={"id": chosen}, headers=B)
    assert b.status_code == 200 and b.json()["length"] == 0
    assert httpx.get(f"{url}/v1/sessions/{chosen}", headers=B).json()["length"] == 0
    assert httpx.get(f"{url}/v1/sessions/{chosen}", headers=A).json()["length"] > 0
    assert httpx.delete(f"{url}/v1/sessions/{chosen}", headers=B).status_code == 200
    assert httpx.get(f"{url}/v1/sessions/{chosen}", headers=A).status_code == 200  # A's is untouched
    # the same id again is a conflict only within one's own namespace
    assert httpx.post(url + "/v1/sessions", json={"id": chosen}, headers=A).status_code == 409
    assert httpx.post(url + "/v1/sessions", json={"id": chosen}, headers=B).status_code == 200
    # B's reading of an id A holds and of one nobody holds are the same answer
    unknown = "nobody-has-" + uuid.uuid4().hex
    for route in ("/v1/responses/{}", "/v1/responses/{}/input_items"):
        held, free = (httpx.get(url + route.format(i), headers=B) for i in (chosen, unknown))
        assert held.status_code == free.status_code == 404
    generated = httpx.post(url + "/v1/sessions", json={}, headers=A).json()["id"]
    assert len(generated) >= 22  # generated ids stay unguessable


def test_the_operators_figures_need_the_operators_key(server):
    url = server.url
    httpx.post(url + "/v1/sessions", json={}, headers=A)
    for route in ("/metrics", "/get_load"):
        assert httpx.get(url + route, headers=A).status_code == 403
        assert httpx.get(url + route).status_code == 401
        assert httpx.get(url + route, headers=OPS).status_code == 200
    text = httpx.get(url + "/metrics", headers=OPS).text
    own = httpx.get(url + "/v1/status", headers=A).json()
    label = own["tenant"]["tenant"]
    assert own["scope"] == "tenant" and f'tenant="{label}"' in text  # the operator sees each tenant by its label
    assert "key-alpha" not in text and label.startswith("t-")
    assert hashlib.sha256(b"key-alpha").hexdigest()[:8] not in text  # not a bare hash of the key
    assert httpx.get(url + "/v1/status", headers=OPS).json()["scope"] == "server"
    theirs = httpx.get(url + "/v1/status", headers=B).json()
    assert theirs["scope"] == "tenant" and all(s["owner"] != label for s in theirs["sessions"])


def test_a_body_over_the_limit_is_413_chunked_or_not(server):
    url, big = server.url, b'{"inputs": "' + b"x" * (80 * 1024) + b'"}'

    def chunks():
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    for content in (big, chunks()):
        r = httpx.post(url + "/generate", content=content, headers={**A, "content-type": "application/json"})
        assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]
    small = b'{"inputs": "hi", "parameters": {"max_new_tokens": 2}}'
    r = httpx.post(url + "/generate", content=iter([small[:10], small[10:]]), headers={**A, "content-type": "application/json"})
    assert r.status_code == 200  # a chunked body within the limit is read whole


def test_errors_quote_at_most_64_characters_of_an_id(server):
    long_id = "a" * 10_000
    r = httpx.get(f"{server.url}/v1/sessions/{long_id}", headers=A)
    assert r.status_code == 404 and len(r.json()["error"]["message"]) < 200


def test_namespaces_hold_across_a_restart_on_the_disk_tier(served_model, tmp_path):
    """Two tenants' sessions under one id, and A's memo on disk: after a restart each tenant gets its own
    session back with its cached history, and B still cannot hit A's blocks, now read from disk."""
    config = EngineConfig(kv_disk=str(tmp_path / "kv"))
    keys = ("key-alpha", "key-beta")
    chosen, secret, stranger = "same-" + uuid.uuid4().hex, memo(), memo()
    with LiveServer(served_model, config, api_keys=keys, name=MODEL) as first:
        for headers, text in ((A, secret), (B, "Just a short note.")):
            assert httpx.post(first.url + "/v1/sessions", json={"id": chosen}, headers=headers).status_code == 200
            turn = {"model": MODEL, "max_tokens": 2, "session_id": chosen, "messages": [{"role": "user", "content": text}]}
            assert httpx.post(first.url + "/v1/chat/completions", json=turn, headers=headers, timeout=120).status_code == 200
            assert httpx.post(f"{first.url}/v1/sessions/{chosen}/snapshot", headers=headers).json()["on_disk"]
        lengths = {k: httpx.get(f"{first.url}/v1/sessions/{chosen}", headers=h).json()["length"] for k, h in (("a", A), ("b", B))}
    assert lengths["a"] > lengths["b"] > 0
    with LiveServer(served_model, config, api_keys=keys, name=MODEL) as second:
        for key, headers in (("a", A), ("b", B)):
            assert httpx.get(f"{second.url}/v1/sessions/{chosen}", headers=headers).json()["length"] == lengths[key]
        chat_cached(second.url, B, memo())  # B's own fixed start of a memo, as before
        assert chat_cached(second.url, B, secret) == chat_cached(second.url, B, stranger)
        assert chat_cached(second.url, A, secret) >= 160  # A's own blocks come back from disk
