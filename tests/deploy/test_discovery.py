"""vllm-router's discovery: a kv_aware router given only the replicas' URLs finds their KV event
publishers through /get_server_info and /kv_event_sources, and routes a repeated prompt by them."""
import subprocess
import time

import httpx
import pytest

from server.cluster import router_binary
from server.config import EngineConfig
from server.local import free_port, wait_healthy

from ..live_server import LiveServer, metric

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def replicas(served_model):
    a, b = (LiveServer(served_model, EngineConfig(kv_events=f"tcp://127.0.0.1:{free_port()}",
                                                  kv_events_replay=f"tcp://127.0.0.1:{free_port()}"))
            for _ in range(2))
    with a, b:
        yield a, b


def test_the_discovery_routes_answer_as_the_router_reads_them(replicas):
    a, _ = replicas
    info = httpx.get(a.url + "/get_server_info").json()
    assert info["model_id"] == MODEL and info["kv_block_size"] == 16 and len(info["instance_id"]) == 32
    assert httpx.get(a.url + "/get_load").json() == {"load": 0, "num_reqs": 0, "num_waiting_reqs": 0}
    sources = httpx.get(a.url + "/kv_event_sources").json()
    assert sources == {"0": {"endpoint": a.engine.config.kv_events, "replay_endpoint": a.engine.config.kv_events_replay,
                             "topic": "", "publisher": "zmq", "encoding": "msgpack", "schema_version": 1,
                             "buffer_steps": 4096, "enable_kv_cache_events": True}}


def test_a_router_with_only_urls_routes_by_the_discovered_events(replicas, tmp_path):
    port, metrics_port = free_port(), free_port()
    router = subprocess.Popen([router_binary(), "--host", "127.0.0.1", "--port", str(port), "--policy", "kv_aware",
                               "--worker-urls", *(r.url for r in replicas), "--prometheus-host", "127.0.0.1",
                               "--prometheus-port", str(metrics_port)],
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "router.log", "w"))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, 60, router)
        prompt = "A long shared context. " + " ".join(f"fact{j} is true." for j in range(120))
        hits_before = [metric(r.url, "kvserve:prefix_cache_hits_total") for r in replicas]
        for _ in range(4):
            r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}, timeout=120)
            assert r.status_code == 200, r.text
            time.sleep(0.3)  # the events of the first reach the router
        hits = [metric(r.url, "kvserve:prefix_cache_hits_total") - h for r, h in zip(replicas, hits_before)]
        lookups = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text
        assert 'vllm_router_kv_placement_lookups_total{result="hit"}' in lookups, (tmp_path / "router.log").read_text()[-3000:]
        inputs = [line for line in lookups.splitlines() if line.startswith("vllm_router_kv_routing_inputs_total")]
        # every prompt's ids came from the render routes: no fallback to /tokenize, no failure
        assert inputs and all('result="render"' in line for line in inputs), inputs
        assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 3 * 16 * 10  # every repeat went where the prompt's KV was
    finally:
        router.terminate()
        router.wait(timeout=30)
