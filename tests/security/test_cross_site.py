"""No cross-site use of a server without keys: what a web page can send without asking first (a form, or
text/plain) does not run, nor does a page whose DNS name was rebound to 127.0.0.1; curl and the
server's own console keep working."""
import httpx
import pytest

from server.config import EngineConfig, ServerConfig

from ..live_server import LiveServer

TURN = b'{"inputs": "Hello", "parameters": {"max_new_tokens": 2}}'


@pytest.fixture(scope="module")
def server(tiny_model):
    config = ServerConfig(model_name="m", allowed_origins=("https://app.example",))
    with LiveServer(tiny_model, EngineConfig(), server_config=config) as s:
        yield s


def sessions(url: str) -> int:
    return len(httpx.get(url + "/v1/sessions").json()["data"])


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_a_cross_site_simple_request_does_not_run(server, kind):
    url, before = server.url, sessions(server.url)
    for origin in ("https://evil.example", "null"):
        r = httpx.post(url + "/v1/sessions", content=b"{}", headers={"content-type": kind, "origin": origin})
        assert r.status_code == 403 and "application/json" in r.json()["error"]["message"]
        r = httpx.post(url + "/generate", content=TURN, headers={"content-type": kind, "origin": origin})
        assert r.status_code == 403
    assert sessions(url) == before  # nothing was made


def test_curl_the_console_and_allowed_origins_still_work(server):
    url = server.url
    # the README's curl: -d without a content type sends a form type and no Origin
    assert httpx.post(url + "/generate", content=TURN, headers={"content-type": "application/x-www-form-urlencoded"}).status_code == 200
    # the server's own page, and an origin the operator allowed
    own = f"http://127.0.0.1:{server.port}"
    for origin in (own, "https://app.example"):
        r = httpx.post(url + "/generate", content=TURN, headers={"content-type": "text/plain", "origin": origin})
        assert r.status_code == 200, r.text
    # JSON from any page is left to CORS: the browser asks first, and a page not allowed gets no CORS headers
    pre = httpx.options(url + "/generate", headers={"origin": "https://evil.example", "access-control-request-method": "POST",
                                                    "access-control-request-headers": "content-type"})
    assert "access-control-allow-origin" not in pre.headers


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "192.168.1.5"])
def test_a_server_on_loopback_answers_only_its_own_host_names(server, host):
    r = httpx.post(server.url + "/v1/sessions", json={}, headers={"host": host})
    assert r.status_code == 400 and "Host" in r.json()["error"]["message"]
    assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 400


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST:1234"])
def test_this_machines_names_are_answered(server, host):
    assert httpx.get(server.url + "/v1/models", headers={"host": host}).status_code == 200


def test_allowed_hosts_adds_names_and_a_wildcard_opens_them(tiny_model):
    config = ServerConfig(model_name="m", allowed_hosts=("kv.internal",))
    with LiveServer(tiny_model, EngineConfig(), server_config=config) as s:
        assert httpx.get(s.url + "/v1/models", headers={"host": "kv.internal:8000"}).status_code == 200
        assert httpx.get(s.url + "/v1/models", headers={"host": "evil.example"}).status_code == 400
    config = ServerConfig(model_name="m", allowed_hosts=("*",))
    with LiveServer(tiny_model, EngineConfig(), server_config=config) as s:
        assert httpx.get(s.url + "/v1/models", headers={"host": "anything.example"}).status_code == 200
