"""Start `kvserve serve` on a free local port for a benchmark, and stop it afterwards."""
from __future__ import annotations

import argparse
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


def add_target_args(ap: argparse.ArgumentParser) -> None:
    """The server a benchmark loads: a URL, or a kvserve it launches itself."""
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--launch", action="store_true", help="start a local kvserve serve for the run")
    ap.add_argument("--serve-args", default="", help="extra arguments for the launched server")
