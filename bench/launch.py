"""Start `kvserve serve` on a free local port for a benchmark, and stop it afterwards."""
from __future__ import annotations

import contextlib
import subprocess
import sys

from server.local import free_port, wait_healthy


@contextlib.contextmanager
def launched_server(model: str, extra: list[str] | None = None, timeout: float = 600):
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port), "--log-level", "warning", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
