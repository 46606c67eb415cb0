"""Start `kvserve serve` on a free local port for a benchmark, and stop it afterwards."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time

import httpx


@contextlib.contextmanager
def launched_server(model: str, extra: list[str] | None = None, timeout: float = 600):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port), "--log-level", "warning", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise TimeoutError("server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
