"""The disk tier (--kv-disk): reading a session's KV back after a restart against recomputing it, bytes
on disk per token, and start-up with stored sessions. Prints JSON.

    python bench/disk_tier.py [--tokens 1000,4000] [--sessions 100] [--rounds 3]

Each round, per history length: a server with the tier takes one turn of that many tokens on a session
and is stopped (SIGTERM: the drain flushes); a new server on the same folder then takes the next turn
(its history read back, only the partial last block recomputed). Recompute is the same turn's history
prefilled by a server with no tier. Both times are the whole request, with one generated token.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from launch import launched_server  # noqa: E402

SERVE = ["--session-capacity", "8192"]


def prompt_of(url: str, n: int, seed: int) -> str:
    """A text of about n tokens (random words, so no prefix is shared with another round)."""
    rng = random.Random(seed)
    words = [f"{rng.choice('bcdfgklmnprstvz')}{rng.choice('aeiou')}{rng.choice('lmnrst')}" for _ in range(n)]
    text = " ".join(words)
    ids = httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    return httpx.post(url + "/detokenize", json={"tokens": ids[:n]}).json()["prompt"]


def turn(url: str, sid: str | None, text: str) -> float:
    body = {"inputs": text, "parameters": {"max_new_tokens": 1}, **({"session_id": sid} if sid else {})}
    start = time.perf_counter()
    r = httpx.post(url + "/generate", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


def read_back(model: str, n: int, seed: int) -> tuple[float, float, int]:
    """-> (seconds for the turn after a restart, seconds for the turn that wrote it, bytes on disk)."""
    with tempfile.TemporaryDirectory() as store:
        args = [*SERVE, "--kv-disk", store]
        with launched_server(model, args) as url:
            text = prompt_of(url, n, seed)
            sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
            first = turn(url, sid, text)
        on_disk = sum(p.stat().st_size for p in Path(store).rglob("*") if p.is_file())
        with launched_server(model, args) as url:
            again = turn(url, sid, " and")
    return again, first, on_disk


def recompute(model: str, n: int, seed: int) -> float:
    with launched_server(model, SERVE) as url:
        text = prompt_of(url, n, seed)
        return turn(url, None, text + " and")


def startup(model: str, sessions: int) -> dict:
    """Seconds from launch to healthy on an empty folder, and on one holding `sessions` sessions."""
    with tempfile.TemporaryDirectory() as store:
        args = [*SERVE, "--kv-disk", store]
        start = time.perf_counter()
        with launched_server(model, args) as url:
            empty = time.perf_counter() - start
            for i in range(sessions):
                sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
                turn(url, sid, f"Session {i}: " + "tell me a story " * 40)
        start = time.perf_counter()
        with launched_server(model, args) as url:
            full = time.perf_counter() - start
            listed = len(httpx.get(url + "/v1/sessions").json()["data"])
    return {"empty_s": round(empty, 2), f"with_{sessions}_sessions_s": round(full, 2), "restored": listed}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", default="1000,4000")
    ap.add_argument("--sessions", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    out = {"model": args.model, "rounds": args.rounds, "history": {}}
    for n in (int(t) for t in args.tokens.split(",")):
        rows = {"read_back_s": [], "recompute_s": [], "bytes_per_token": []}
        for r in range(args.rounds):  # in turns, so drift hits both sides alike
            again, _, on_disk = read_back(args.model, n, seed=r)
            rows["read_back_s"].append(round(again, 3))
            rows["recompute_s"].append(round(recompute(args.model, n, seed=r), 3))
            rows["bytes_per_token"].append(round(on_disk / n))
        rows["median_read_back_s"] = statistics.median(rows["read_back_s"])
        rows["median_recompute_s"] = statistics.median(rows["recompute_s"])
        out["history"][n] = rows
    if args.sessions:
        out["startup"] = startup(args.model, args.sessions)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
