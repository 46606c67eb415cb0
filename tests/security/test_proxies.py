"""Proxies that cannot be spoofed: a tenant header counts only from a --trusted-proxy judged by the socket's
peer, whatever X-Forwarded-For says; and the gateway recipe of docs/scaling.md through a real nginx."""
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from server.config import EngineConfig, ServerConfig

from ..live_server import LiveServer, free_port

RECIPE = Path(__file__).parents[2] / "docs" / "scaling.md"


def from_address(address: str) -> httpx.Client:
    """A client whose connections leave from this loopback address (all of 127/8 is this machine)."""
    return httpx.Client(transport=httpx.HTTPTransport(local_address=address), timeout=60)


def sessions_of(client: httpx.Client, url: str, headers: dict) -> list[str]:
    return [s["id"] for s in client.get(url + "/v1/sessions", headers=headers).json()["data"]]


def test_x_forwarded_for_does_not_make_a_client_a_trusted_proxy(tiny_model):
    config = ServerConfig(model_name="m", tenant_header="X-Tenant", trusted_proxies=("127.0.0.2",))
    with LiveServer(tiny_model, EngineConfig(), server_config=config) as server:
        url = server.url
        with from_address("127.0.0.2") as proxy, from_address("127.0.0.1") as local:
            sid = proxy.post(url + "/v1/sessions", json={}, headers={"x-tenant": "alice"}).json()["id"]
            assert sessions_of(proxy, url, {"x-tenant": "alice"}) == [sid]  # the real proxy's tenant
            spoof = {"x-tenant": "alice", "x-forwarded-for": "127.0.0.2"}
            assert sessions_of(local, url, spoof) == []  # the local client is no one's alice
            assert local.get(f"{url}/v1/sessions/{sid}", headers=spoof).status_code == 404
            assert local.delete(f"{url}/v1/sessions/{sid}", headers=spoof).status_code == 404
            assert proxy.get(f"{url}/v1/sessions/{sid}", headers={"x-tenant": "alice"}).status_code == 200


def test_a_trusted_gateway_that_adds_x_forwarded_for_keeps_its_tenants(tiny_model):
    config = ServerConfig(model_name="m", tenant_header="X-Tenant", trusted_proxies=("127.0.0.1",))
    with LiveServer(tiny_model, EngineConfig(), server_config=config) as server:
        url = server.url
        gateway = {"x-tenant": "alice", "x-forwarded-for": "203.0.113.9"}
        with httpx.Client(timeout=60) as client:
            sid = client.post(url + "/v1/sessions", json={}, headers=gateway).json()["id"]
            assert sessions_of(client, url, gateway) == [sid]
            assert sessions_of(client, url, {"x-forwarded-for": "203.0.113.9"}) == []  # not the anonymous tenant's
            assert sessions_of(client, url, {"x-tenant": "bob", "x-forwarded-for": "203.0.113.9"}) == []


def nginx_conf(work: Path, listen: int, upstream: int) -> str:
    """docs/scaling.md's gateway block, on these ports, inside the rest of an nginx.conf."""
    block = re.search(r"```nginx\n(.*?)```", RECIPE.read_text(), re.S).group(1)
    block = block.replace("127.0.0.1:8080", f"127.0.0.1:{listen}").replace("127.0.0.1:8000", f"127.0.0.1:{upstream}")
    temp = "\n".join(f"{kind}_temp_path {work / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return (f"worker_processes 1;\ndaemon off;\npid {work / 'nginx.pid'};\nerror_log {work / 'error.log'} warn;\n"
            f"events {{ worker_connections 64; }}\nhttp {{\naccess_log off;\n{temp}\n{block}\n}}\n")


def test_the_documented_nginx_gateway_names_tenants_and_cannot_be_bypassed(tiny_model, tmp_path):
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        pytest.skip("nginx is not installed (make test installs it)")
    config = ServerConfig(model_name="m", tenant_header="X-Tenant", trusted_proxies=("127.0.0.2",))
    with LiveServer(tiny_model, EngineConfig(), server_config=config) as server:
        port = free_port()
        (tmp_path / "nginx.conf").write_text(nginx_conf(tmp_path, port, server.port))
        nginx = subprocess.Popen([binary, "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path)])
        try:
            front = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 30
            while True:
                try:
                    httpx.get(front + "/health", timeout=2)
                    break
                except httpx.TransportError:
                    assert time.monotonic() < deadline and nginx.poll() is None, (tmp_path / "error.log").read_text()
                    time.sleep(0.1)
            alice, bob = {"x-gateway-key": "alice-gateway-key"}, {"x-gateway-key": "bob-gateway-key"}
            with httpx.Client(timeout=60) as client:
                assert client.get(front + "/v1/sessions").status_code == 401  # the gateway wants its key
                sid = client.post(front + "/v1/sessions", json={}, headers=alice).json()["id"]
                turn = {"inputs": "hi", "session_id": sid, "parameters": {"max_new_tokens": 2}}
                assert client.post(front + "/generate", json=turn, headers=alice).status_code == 200
                assert sessions_of(client, front, alice) == [sid]
                assert sessions_of(client, front, bob) == []
                # a client's own tenant header is overwritten by the gateway's
                assert sessions_of(client, front, {**bob, "x-tenant": "alice"}) == []
                # around the gateway, straight to kvserve: neither the header nor X-Forwarded-For is honoured
                spoof = {"x-tenant": "alice", "x-forwarded-for": "127.0.0.2"}
                assert sessions_of(client, server.url, spoof) == []
                assert client.get(f"{server.url}/v1/sessions/{sid}", headers=spoof).status_code == 404
        finally:
            nginx.terminate()
            nginx.wait(timeout=30)
