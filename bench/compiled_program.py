"""Served output tokens/s with the program as Python (`--enforce-eager`) and as its compiled package, in turns:
one streamed completion at a time, then N concurrent streams. Prints JSON.

    python bench/compiled_program.py [--model smollm2-135m-instruct] [--rounds 2] [--streams 8]

Compile the package first (`python -m models.compiled_program ARTIFACT`, or let a `kvserve serve` do it),
or the "compiled" turns run program.py too (the JSON's "compiled" field says which ran).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from models import DEFAULT_MODEL, load_model
from server.local import free_port, wait_healthy


def stream(url: str, tokens: int) -> float:
    """One streamed completion that never stops early -> its output tokens/s."""
    body = {"prompt": "Tell me a long story about a fox.", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for _ in r.iter_lines():
            pass
    return tokens / (time.perf_counter() - start)


def turn(model: str, eager: bool, streams: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--port", str(port)] + (["--enforce-eager"] if eager else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=600, proc=proc)
        stream(url, 16)  # warm
        one = [stream(url, 128) for _ in range(3)]
        start = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(lambda _: stream(url, 64), range(streams)))
        many = streams * 64 / (time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait()
    return {"one_stream": [round(x, 1) for x in one], f"{streams}_streams": round(many, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    args = ap.parse_args()
    compiled = load_model(args.model, weights="auto").forward.compiled
    runs = {"eager": [], "compiled": []}
    for _ in range(args.rounds):
        for name in runs:
            runs[name].append(turn(args.model, name == "eager", args.streams))
    medians = {name: {"one_stream": statistics.median(x for r in rs for x in r["one_stream"]),
                      f"{args.streams}_streams": statistics.median(r[f"{args.streams}_streams"] for r in rs)}
               for name, rs in runs.items()}
    print(json.dumps({"model": args.model, "compiled": compiled, "runs": runs, "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
