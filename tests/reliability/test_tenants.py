"""Tenants over HTTP: per-key quotas, idle expiry, deadlines, admission that counts what fits, and
per-tenant figures, against a real server."""
import asyncio
import time
from pathlib import Path

import httpx
import pytest

from models.loader import load_model
from server.config import EngineConfig, ServerConfig

from ..live_server import LiveServer, metric, metrics

A, B = {"authorization": "Bearer alpha-secret"}, {"authorization": "Bearer beta-secret"}
OPS = {"authorization": "Bearer ops-secret"}  # the operator's --admin-key


@pytest.fixture(scope="module")
def tiny(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["llama"]))


def generate(url, sid, text, n, headers=None, **params):
    body = {"inputs": text, "session_id": sid, "parameters": {"max_new_tokens": n, "details": True, **params}}
    return httpx.post(url + "/generate", json=body, headers=headers or {}, timeout=120)


def listed(url, headers=None):
    return [s["id"] for s in httpx.get(url + "/v1/sessions", headers=headers or {}).json()["data"]]


def tenant_metric(url, name, label, headers=None):
    return sum(v for k, v in metrics(url, headers).items() if k.startswith(name + "{") and f'tenant="{label}"' in k)


def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.05)
    return predicate()


def test_one_key_at_its_session_quota_leaves_the_others_room(tiny):
    config = EngineConfig(max_sessions=8, max_sessions_per_key=3)
    server_config = ServerConfig(model_name="m", admin_key="ops-secret")
    with LiveServer(tiny, config, api_keys=("alpha-secret", "beta-secret"), server_config=server_config) as server:
        url = server.url
        made = [httpx.post(url + "/v1/sessions", json={}, headers=A) for _ in range(3)]
        assert [r.status_code for r in made] == [200] * 3
        refused = httpx.post(url + "/v1/sessions", json={}, headers=A)
        assert refused.status_code == 429 and "its limit of 3 sessions" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1
        assert httpx.post(url + "/v1/sessions", json={}, headers=B).status_code == 200  # b is unaffected
        assert len(listed(url, A)) == 3 and len(listed(url, B)) == 1
        httpx.delete(url + f"/v1/sessions/{made[0].json()['id']}", headers=A)
        assert httpx.post(url + "/v1/sessions", json={}, headers=A).status_code == 200  # the delete freed a slot
        status = httpx.get(url + "/v1/status", headers=A).json()
        assert status["scope"] == "tenant" and status["tenant"]["sessions"] == 3 and status["tenant"]["rejected"] == 1
        assert status["tenant"]["limits"]["sessions"] == 3 and status["steps"] is None  # nothing of the others' load
        assert httpx.get(url + "/metrics", headers=B).status_code == 403  # every tenant's figures: the operator's
        text = httpx.get(url + "/metrics", headers=OPS).text
        assert "alpha-secret" not in text and "beta-secret" not in text  # labels are HMACs, never the keys
        label_a = status["tenant"]["tenant"]
        assert tenant_metric(url, "kvserve:tenant_requests_rejected_total", label_a, OPS) == 1
        assert tenant_metric(url, "kvserve:tenant_sessions", label_a, OPS) == 3


def test_a_gateways_tenant_header_separates_tenants_under_one_key(tiny):
    config = EngineConfig(max_sessions_per_key=2)
    server_config = ServerConfig(model_name="m", tenant_header="X-Tenant")
    with LiveServer(tiny, config, api_keys=("gateway",), server_config=server_config) as server:
        gw = {"authorization": "Bearer gateway"}
        for tenant in ("alice", "bob"):
            for _ in range(2):
                assert httpx.post(server.url + "/v1/sessions", json={}, headers={**gw, "x-tenant": tenant}).status_code == 200
        assert httpx.post(server.url + "/v1/sessions", json={}, headers={**gw, "x-tenant": "alice"}).status_code == 429
        assert len(listed(server.url, {**gw, "x-tenant": "bob"})) == 2
        assert listed(server.url, gw) == []  # the gateway's own tenant holds none of them


@pytest.mark.parametrize("proxy, separate", [("10.9.9.9", False), ("127.0.0.1", True)])
def test_only_a_listed_proxy_names_a_tenant_without_a_key(tiny, proxy, separate):
    server_config = ServerConfig(model_name="m", tenant_header="X-Tenant", trusted_proxies=(proxy,))
    with LiveServer(tiny, EngineConfig(), server_config=server_config) as server:
        sid = httpx.post(server.url + "/v1/sessions", json={}, headers={"x-tenant": "alice"}).json()["id"]
        # from an unlisted address the header is ignored: one tenant, as without keys
        assert listed(server.url) == ([] if separate else [sid])
        assert listed(server.url, {"x-tenant": "alice"}) == [sid]


def test_an_idle_session_expires_and_its_kv_returns_to_the_pool(tiny):
    with LiveServer(tiny, EngineConfig(session_ttl=2.0)) as server:
        url = server.url
        baseline = metric(url, "kvserve:kv_cache_usage_bytes")
        idle = httpx.post(url + "/v1/sessions", json={}).json()
        used = httpx.post(url + "/v1/sessions", json={}).json()["id"]
        assert generate(url, idle["id"], "An idle session", 8).status_code == 200
        assert idle["expires_at"] == pytest.approx(time.time() + 2.0, abs=1.0)
        assert metric(url, "kvserve:kv_cache_usage_bytes") > baseline
        for _ in range(6):  # each use renews the other one's TTL
            assert generate(url, used, " and more", 2).status_code == 200
            time.sleep(0.5)
        assert wait_for(lambda: idle["id"] not in listed(url), timeout=5)
        assert used in listed(url)
        assert httpx.get(url + f"/v1/sessions/{idle['id']}").status_code == 404
        httpx.delete(url + f"/v1/sessions/{used}")
        assert wait_for(lambda: metric(url, "kvserve:kv_cache_usage_bytes") == baseline, timeout=5)


def test_a_session_in_use_never_expires_mid_request(served_model):
    with LiveServer(served_model, EngineConfig(session_ttl=0.5)) as server:
        sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
        start = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Count to one thousand:", "max_tokens": 300,
                                                             "ignore_eos": True, "session_id": sid}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 300
        assert time.monotonic() - start > 1.0  # the request outlived the TTL twice over
        info = httpx.get(server.url + f"/v1/sessions/{sid}")
        assert info.status_code == 200 and info.json()["length"] > 300


def test_an_expired_session_moves_to_disk_and_its_disk_copy_expires_too(tmp_path, tiny):
    config = EngineConfig(session_ttl=1.0, session_disk_ttl=3.0, kv_disk=str(tmp_path))
    with LiveServer(tiny, config) as server:
        url = server.url
        sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
        first = generate(url, sid, "Remember this", 6)
        length = httpx.get(url + f"/v1/sessions/{sid}").json()["length"]
        assert wait_for(lambda: sid not in listed(url), timeout=5)  # out of RAM ...
        records = list(Path(tmp_path).glob(f"*/sessions/{sid}.json"))
        assert len(records) == 1
        back = httpx.get(url + f"/v1/sessions/{sid}")  # ... and back from disk when named
        assert back.status_code == 200 and back.json()["length"] == length and first.status_code == 200
        assert wait_for(lambda: sid not in listed(url), timeout=5)
        # gone for good once the disk TTL has passed as well
        assert wait_for(lambda: not records[0].exists(), timeout=10)
        assert httpx.get(url + f"/v1/sessions/{sid}").status_code == 404


def test_a_deadline_ends_a_running_request_with_its_text_and_refuses_a_queued_one(served_model):
    with LiveServer(served_model, EngineConfig(max_running=1)) as server:
        url = server.url
        baseline = metric(url, "kvserve:kv_cache_usage_bytes")
        start = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2000,
                                                      "ignore_eos": True, "timeout": 0.5}, timeout=60)
        took = time.monotonic() - start
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "timeout" and choice["text"] and 0.45 < took < 1.5, (choice, took)
        assert 0 < r.json()["usage"]["completion_tokens"] < 2000
        assert wait_for(lambda: metric(url, "kvserve:kv_cache_usage_bytes") == baseline, timeout=5)

        sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
        assert generate(url, sid, "Kept history", 3).status_code == 200
        before = httpx.get(url + f"/v1/sessions/{sid}").json()["length"]

        async def both():
            async with httpx.AsyncClient(timeout=60) as ac:
                long = asyncio.ensure_future(ac.post(url + "/v1/completions", json={
                    "prompt": "A long story", "max_tokens": 200, "ignore_eos": True}))
                await asyncio.sleep(0.2)  # it holds the one running slot
                queued = await ac.post(url + "/generate", json={
                    "inputs": " more", "session_id": sid, "parameters": {"max_new_tokens": 5, "timeout": 0.3}})
                return queued, await long

        queued, long = asyncio.run(both())
        assert long.status_code == 200
        assert queued.status_code == 408 and queued.json()["error"]["type"] == "timeout_error", queued.text
        assert httpx.get(url + f"/v1/sessions/{sid}").json()["length"] == before  # the refused turn changed nothing


def test_the_server_wide_timeout_bounds_every_request(served_model):
    with LiveServer(served_model, EngineConfig(request_timeout=0.4)) as server:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "timeout"
        # a request's own timeout may only shorten it
        r = httpx.post(server.url + "/v1/completions", json={**body, "timeout": 60, "max_tokens": 1500}, timeout=60)
        assert r.json()["choices"][0]["finish_reason"] == "timeout" and r.json()["usage"]["completion_tokens"] < 1500


def test_a_burst_is_taken_up_to_running_plus_queued(served_model):
    with LiveServer(served_model, EngineConfig(max_running=2, max_queued=2)) as server:
        async def burst():
            async with httpx.AsyncClient(timeout=120) as ac:
                body = {"prompt": "Write a poem about", "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*(ac.post(server.url + "/v1/completions", json=body) for _ in range(8)))

        codes = [r.status_code for r in asyncio.run(burst())]
    # two run and two queue: refused only what exceeds both (the burst arrives well within one reply)
    assert sorted(codes) == [200] * 4 + [429] * 4, codes
