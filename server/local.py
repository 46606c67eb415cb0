"""Running a server on this machine: a free loopback port, waiting until it answers /health, stopping it."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None) -> None:
    """Poll url/health until it answers 200; fail early if `proc` exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:  # urllib, not httpx: `kvserve serve` imports this module, and httpx costs its start-up a third of a second
            with urllib.request.urlopen(url + "/health", timeout=1.0) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy within {timeout:.0f}s")


def stop(procs: list[subprocess.Popen], timeout: float = 60) -> None:
    """SIGTERM to each, then a kill for any still running after `timeout` s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()


def exit_now(code: int) -> None:
    """Ends this process once all is stopped and saved: logging and stdio flushed, then os._exit. The
    interpreter's own exit would collect every object the model, tokenizer and torch made and run their
    modules' teardown, seconds past a --shutdown-timeout, with nothing left to save."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
