"""Start `kvserve serve`, or `kvserve cluster`, on a free local port for a benchmark, and stop it afterwards."""
from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys
import time

import httpx

from models.quant import ACTIVATIONS
from server.local import free_port, stop, wait_healthy


@contextlib.contextmanager
def running(cmd: list[str], port: int, timeout: float, **popen):
    """A server started with `cmd` on 127.0.0.1:`port`, once its /health answers -> its URL; stopped after."""
    proc = subprocess.Popen(cmd, **popen)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout, proc)
        yield url
    finally:
        stop([proc], timeout=120)


def warm_up(url: str) -> None:
    """A first, unmeasured request: a server's route set-up and first step are not the load's."""
    httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=300)


def compiled(model: str, activations: str) -> None:
    """`model`'s artifact and its compiled program, made before a measured server starts: `kvserve serve`
    makes what is missing in the background, and its first minute would run program.py beside a compile
    that takes one of the two cores."""
    code = ("import subprocess, sys; from models import load_model; "
            "f = load_model(sys.argv[1], weights='auto', activations=sys.argv[2]).folder; "
            "(f / 'program.pt2').is_file() or subprocess.run([sys.executable, '-m', 'models.compiled_program', str(f)], check=True)")
    subprocess.run([sys.executable, "-c", code, model, activations], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def launched_server(model: str, extra: list[str] | None = None, timeout: float = 600):
    extra = extra or []
    compiled(model, extra[extra.index("--activations") + 1] if "--activations" in extra else ACTIVATIONS[0])
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port), "--log-level", "warning", *extra]
    return running(cmd, port, timeout, stdout=subprocess.DEVNULL)


@contextlib.contextmanager
def launched_cluster(model: str, replicas: int, policy: str, cores_per_replica: int | None = None,
                     extra: list[str] | None = None, timeout: float = 900):
    """`kvserve cluster` -> (its URL, the replicas' URLs)."""
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "cluster", "--model", model, "--replicas", str(replicas), "--policy", policy,
           "--port", str(port), *(["--cores-per-replica", str(cores_per_replica)] if cores_per_replica else []),
           "--", "--log-level", "warning", *(extra or [])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        urls, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"kvserve cluster exited with {proc.wait()}")
            if m := re.match(r"replica (\S+) on cores", line):
                urls.append(m.group(1))
            elif line.startswith("router"):
                break
        yield f"http://127.0.0.1:{port}", urls
    finally:
        stop([proc], timeout=120)


def add_target_args(ap: argparse.ArgumentParser) -> None:
    """The server a benchmark loads: a URL, or a kvserve it launches itself."""
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--launch", action="store_true", help="start a local kvserve serve for the run")
    ap.add_argument("--serve-args", default="", help="extra arguments for the launched server")
