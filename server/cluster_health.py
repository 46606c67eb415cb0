"""The cluster's own /health: 200 while any replica serves, 503 only when none does, with each replica's
state in the body; and /metrics with one `kvserve_cluster_replica_up` gauge per replica.

vllm-router's /health is all or nothing: once one replica is dead it answers 503 ("Unhealthy servers:
[...]") for good, although it routes on to the others. A healthcheck (docker compose's `scale` profile)
that reads it would call a serving cluster dead. `kvserve cluster` serves this endpoint on a loopback
port from a thread of its own; with --nginx, nginx sends the public /health here. Each request asks
every replica's /health afresh, so the answer is never stale and there is no poller to keep alive.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROBE_TIMEOUT_S = 2  # a replica too busy to answer its /health in this long counts as not serving


def probe(url: str) -> bool:
    try:  # urllib, as server/local.py: no client library in the cluster process's way
        with urllib.request.urlopen(url + "/health", timeout=PROBE_TIMEOUT_S) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ClusterHealth:
    def __init__(self, replicas: list[str]) -> None:
        self.replicas = replicas
        self.pool = ThreadPoolExecutor(max(1, len(replicas)), thread_name_prefix="cluster-health")

    def states(self) -> list[dict]:
        """[{url, healthy}] per replica, asked all at once: one hung replica costs one timeout, not N."""
        return [{"replica": i, "url": u, "healthy": ok}
                for i, (u, ok) in enumerate(zip(self.replicas, self.pool.map(probe, self.replicas)), start=1)]

    def health(self) -> tuple[int, dict]:
        states = self.states()
        serving = sum(s["healthy"] for s in states)
        body = {"status": "ok" if serving else "unavailable", "serving": serving, "replicas": states}
        return (200 if serving else 503), body

    def metrics(self) -> str:
        lines = ["# HELP kvserve_cluster_replica_up 1 while the replica answers its /health, else 0",
                 "# TYPE kvserve_cluster_replica_up gauge"]
        lines += [f'kvserve_cluster_replica_up{{replica="{s["replica"]}",url="{s["url"]}"}} {int(s["healthy"])}'
                  for s in self.states()]
        return "\n".join(lines) + "\n"


def serve_health(health: ClusterHealth, host: str, port: int) -> ThreadingHTTPServer:
    """Serves /health and /metrics on host:port from a daemon thread; shut it down with .shutdown()."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            path = self.path.split("?", 1)[0]
            if path == "/health":
                status, body = health.health()
                self.reply(status, "application/json", json.dumps(body).encode())
            elif path == "/metrics":
                self.reply(200, "text/plain; version=0.0.4", health.metrics().encode())
            else:
                error = {"error": {"message": f"no route {path}", "type": "not_found_error", "param": None, "code": 404}}
                self.reply(404, "application/json", json.dumps(error).encode())

        def reply(self, status: int, kind: str, data: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass  # healthchecks poll this every few seconds: their lines would bury the replicas'

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="cluster-health", daemon=True).start()
    return server
