"""`kvserve cluster` when a replica dies: the cluster's /health, nginx's errors, its logs and its CORS
headers, through the real nginx, the real vllm-router and real replicas on the tiny model."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from server.cluster_health import ClusterHealth
from server.local import free_port

MODEL = "smollm2-135m-instruct"
EVIL = "http://evil.example"


def start_cluster(replicas: int, *flags: str, serve: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str, dict, str]:
    """-> the cluster, its URL, {replica URL: pid} and the log file its stdout and stderr both go to (a
    pipe nobody reads to the end would fill and stall the replicas, whose lines pass through it)."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "cluster", "--replicas", str(replicas), "--port", str(port),
                             *flags, "--", *serve], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = open(log.name).read()
        if m := re.search(r"^router .* on (\S+)$", text, re.M):
            pids = {u: int(p) for u, p in re.findall(r"^replica (\S+) on cores \S+, pid (\d+)", text, re.M)}
            return proc, m.group(1), pids, log.name
        assert proc.poll() is None, text[-3000:]
        time.sleep(0.5)
    proc.kill()
    raise AssertionError("kvserve cluster did not come up")


def stop_cluster(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def is_kvserve_error(r: httpx.Response, status: int | None = None) -> dict:
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == r.status_code, error
    assert status is None or r.status_code == status, (r.status_code, error)
    return error


def health(url: str) -> httpx.Response:
    r = httpx.get(url + "/health", timeout=15)
    assert r.headers["content-type"] == "application/json", r.text
    return r


def test_a_dead_replica_leaves_a_healthy_cluster_json_errors_and_quiet_tagged_logs():
    health_port = free_port()
    proc, url, pids, log = start_cluster(2, "--nginx", "--health-port", str(health_port))
    try:
        r = health(url)
        assert r.status_code == 200 and [s["healthy"] for s in r.json()["replicas"]] == [True, True], r.text
        assert sorted(s["url"] for s in r.json()["replicas"]) == sorted(pids)

        # kvserve allows no origin by default: neither the router's routes nor a replica's may say otherwise
        for headers in ({}, {"X-Session-Id": "s" * 24}):
            r = httpx.get(url + "/v1/models", headers={"Origin": EVIL, **headers}, timeout=30)
            assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, r.headers
        r = httpx.options(url + "/v1/chat/completions", timeout=30,
                          headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in r.headers, r.headers

        sid = "victim-session-" + "x" * 12
        assert httpx.post(url + "/v1/sessions", headers={"X-Session-Id": sid}, json={}, timeout=30).status_code == 200
        home = [u for u in pids if any(s["id"] == sid for s in httpx.get(u + "/v1/sessions", timeout=30).json()["data"])]
        assert len(home) == 1, home
        victim = home[0]

        # a turn long enough to be in flight on the victim when it dies
        answer = {}

        def long_turn():
            body = {"model": MODEL, "max_tokens": 1900, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "Count to ten thousand."}]}
            try:
                answer["r"] = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": sid}, json=body, timeout=60)
            except httpx.TransportError as e:
                answer["e"] = e
        turn = threading.Thread(target=long_turn)
        turn.start()
        time.sleep(3)
        assert not answer  # still running: its replica dies under it
        os.kill(pids[victim], signal.SIGKILL)
        turn.join(90)
        assert not turn.is_alive()  # no hang
        # the POST was sent, so it may have run: nginx does not run it again elsewhere, it answers JSON
        assert "r" in answer, answer
        error = is_kvserve_error(answer["r"], 502)
        assert error["type"] == "unavailable_error" and answer["r"].headers["retry-after"] == "1"

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the cluster process notices the death within a second or two
            if "exited with -9" in open(log).read():
                break
            time.sleep(0.5)
        r = health(url)
        assert r.status_code == 200, r.text  # one replica serves: so does the cluster
        states = {s["url"]: s["healthy"] for s in r.json()["replicas"]}
        assert states == {u: u != victim for u in pids} and r.json()["serving"] == 1, r.text
        gauges = dict(re.findall(r'kvserve_cluster_replica_up\{replica="\d",url="([^"]+)"\} (\d)',
                                 httpx.get(f"http://127.0.0.1:{health_port}/metrics", timeout=15).text))
        assert gauges == {u: "0" if u == victim else "1" for u in pids}, gauges  # the death shows in metrics too

        # the dead replica's session hashes to the next one, which never held it (no shared --kv-disk):
        # an answer in JSON, quickly, whichever replica gives it
        for _ in range(3):
            r = httpx.get(f"{url}/v1/sessions/{sid}", timeout=30)
            is_kvserve_error(r, 404)
            r = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=60,
                           json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200 or is_kvserve_error(r), r.text
        # the router routes on, once its own health checks have taken the dead replica out
        deadline = time.monotonic() + 30
        while (r := httpx.get(url + "/v1/models", timeout=30)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert r.status_code == 200, r.text
        assert proc.poll() is None
    finally:
        stop_cluster(proc)
    lines = open(log).read().splitlines()
    for i in (1, 2):
        assert any(line.startswith(f"[replica {i}] ") and "listening on" in line for line in lines)
    assert any(line.startswith(f"[replica {i}] ") and "POST /v1/sessions" in line for line in lines for i in (1, 2))
    assert any(line.startswith("[router] ") for line in lines)
    noisy = [line for line in lines if re.search(r"GET /(health|get_load)\b", line)]
    assert not noisy, noisy[:5]


def test_without_session_routing_nginx_still_fronts_the_router_its_origins_and_health_are_the_clusters():
    health_port = free_port()
    proc, url, pids, log = start_cluster(1, "--health-port", str(health_port),
                                         serve=("--allowed-origins", "http://a.example"))
    try:
        assert re.search(r"^router \(kv_aware\), behind nginx, on ", open(log).read(), re.M)
        r = httpx.get(url + "/v1/models", headers={"Origin": "http://a.example"}, timeout=30)
        assert r.headers.get("access-control-allow-origin") == "http://a.example", r.headers
        r = httpx.get(url + "/v1/models", headers={"Origin": EVIL}, timeout=30)
        assert "access-control-allow-origin" not in r.headers, r.headers
        # the public /health is the cluster's own, as the printed URL says
        assert re.search(r"^cluster health on (\S+)/health$", open(log).read(), re.M).group(1) == url
        r = health(url)
        assert r.status_code == 200 and r.json()["replicas"] == [{"replica": 1, "url": next(iter(pids)), "healthy": True}]
        metrics = httpx.get(f"http://127.0.0.1:{health_port}/metrics").text
        assert re.search(r'kvserve_cluster_replica_up\{replica="1",url="[^"]+"\} 1', metrics)
        # the one replica killed: the router's plain-text 5xx reaches the client as kvserve's JSON
        os.kill(next(iter(pids.values())), signal.SIGKILL)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2}, timeout=60)
        assert r.status_code >= 500 and "127.0.0.1" not in r.text
        is_kvserve_error(r, r.status_code)
    finally:
        stop_cluster(proc)


def test_the_clusters_health_is_503_only_when_no_replica_answers():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]  # nothing listens there
    status, body = ClusterHealth(dead).health()
    assert status == 503 and body["serving"] == 0 and not any(s["healthy"] for s in body["replicas"])
