"""Start-up time (fetched model to listening) and resident memory, at idle and at its peak, of
`kvserve serve`. Prints JSON.

    python bench/startup.py [--model smollm2-135m-instruct] [--weights auto]

The first start after a code change also exports the model, and Python compiles the modules it
imports; the figure that matters is a start from the warm cache (the artifact and the bytecode), so
the script starts the server twice and reports both. PYTHONDONTWRITEBYTECODE is dropped from the
servers' environment, as the Makefile drops it: with it, no start would ever be warm.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

from server.local import free_port


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """The server's resident memory (VmHWM: its peak so far), its children's added."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in open(f"/proc/{p}/status"):
                if line.startswith(field + ":"):
                    total += int(line.split()[1])
        except FileNotFoundError:
            pass
    return round(total / 1024, 1)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except FileNotFoundError:
        return []


def start_once(model: str, weights: str) -> dict:
    port = free_port()
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", model, "--weights", weights,
                             "--port", str(port)], stdout=subprocess.DEVNULL, stderr=log,
                            env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})
    try:
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
            if proc.poll() is not None:
                raise RuntimeError("server exited")
        ready = time.perf_counter() - t0
        time.sleep(2)
        out = {"startup_s": round(ready, 2), "idle_rss_mb": rss_mb(proc.pid), "peak_rss_mb": rss_mb(proc.pid, "VmHWM")}
        # a fresh export serves while its artifact is written: the next start is a cached one only once it is
        while _log_says(log, "saving it in the background") and not _log_says(log, "saved the artifact", "could not save"):
            time.sleep(0.5)
            if proc.poll() is not None:
                raise RuntimeError("server exited while saving its artifact")
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


def _log_says(log, *texts: str) -> bool:
    log.seek(0)
    text = log.read()
    return any(t in text for t in texts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--weights", default="auto")
    args = ap.parse_args()
    first = start_once(args.model, args.weights)
    cached = start_once(args.model, args.weights)
    print(json.dumps({"model": args.model, "weights": args.weights, "first_start": first, "cached_start": cached,
                      "targets": {"startup_s": 3, "idle_rss_mb": 450}}, indent=2))


if __name__ == "__main__":
    main()
