"""A real uvicorn server on 127.0.0.1 and a free port, running in a background thread."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import httpx
import uvicorn

from server.api.app import create_app
from server.config import EngineConfig, ServerConfig
from server.engine.engine import Engine
from server.listener import uvicorn_config
from server.local import free_port, wait_healthy

__all__ = ["HealthWatch", "LiveServer", "free_port", "metric", "metrics", "start_cli_server", "wait_healthy"]


class LiveServer:
    """In-process server, so tests can also look at the engine and the cache registry."""

    def __init__(self, model, engine_config: EngineConfig | None = None, api_keys=(), name="smollm2-135m-instruct",
                 server_config: ServerConfig | None = None, port: int | None = None):
        self.engine = Engine(model, engine_config or EngineConfig())
        server_config = server_config or ServerConfig(model_name=name)
        self.app = create_app(self.engine, server_config, frozenset(api_keys))
        self.port = port or free_port()  # a port of its own, or a stopped server's again (a restart)
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", self.port, log_level="warning",
                                                    header_timeout=server_config.header_timeout))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        wait_healthy(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_cli_server(args: list[str], port: int) -> subprocess.Popen:
    """`kvserve serve` as its own process (for signal and CLI tests)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """Prometheus samples of /metrics as {name{labels}: value} (labels as printed)."""
    out = {}
    for line in httpx.get(url + "/metrics", headers=headers or {}).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(url: str, prefix: str, headers: dict | None = None) -> float:
    """Sum of every sample whose name starts with `prefix`."""
    return sum(v for k, v in metrics(url, headers).items() if k.startswith(prefix))


class HealthWatch:
    """Polls /health from a thread while requests run: `slowest` is the longest answer it saw, `failures`
    the polls that got no 200 (a crashed or frozen server)."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self.polls, self.failures = url, 0.0, 0, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._done.is_set():
                began = time.monotonic()
                try:
                    self.failures += client.get(self.url + "/health").status_code != 200
                except httpx.HTTPError:
                    self.failures += 1
                self.slowest = max(self.slowest, time.monotonic() - began)
                self.polls += 1
                time.sleep(0.02)

    def __enter__(self) -> "HealthWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=60)
