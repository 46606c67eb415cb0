"""Multi-turn chat load, as an ordinary chat client makes it: every turn resends the whole conversation.

    python bench/multiturn.py --launch                         # starts kvserve itself
    python bench/multiturn.py --url http://127.0.0.1:8080      # llama-server or any OpenAI-compatible server
    python bench/multiturn.py --launch --sessions              # kvserve's sessions: X-Session-Id per user

Each of --users users opens with a message of about --first-words words, then sends --turns turns in
a row, each adding the assistant's last reply and a new message of about --turn-words words, and
streams --output-len tokens of reply (greedy, ignore_eos). Users run concurrently, each waiting for its
reply before its next turn. Prints JSON: output tok/s over the run, and TTFT (p50, p90) for each turn
and for the last two turns together.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from launch import add_target_args, launched_server  # noqa: E402
from serve_bench import WORDS, sse_events, summary  # noqa: E402


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, int(rng.uniform(0.75, 1.25) * words)))) + "."


async def turn(client: httpx.AsyncClient, url: str, model: str, messages: list[dict], max_tokens: int,
               headers: dict) -> tuple[float, str, int]:
    """One streamed chat turn -> (TTFT s, reply text, completion tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start, ttft, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for event in sse_events(r):
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            delta = (event.get("choices") or [{}])[0].get("delta", {}).get("content")
            if delta:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text.append(delta)
    return (ttft if ttft is not None else time.perf_counter() - start), "".join(text), tokens


async def user(i: int, client, args, ttfts: list[list[float]], errors: list[str]) -> int:
    rng = random.Random(args.seed * 1000 + i)
    headers = {}
    if args.sessions:
        r = await client.post(args.url + "/v1/sessions", json={})
        headers = {"X-Session-Id": r.json()["id"]}
    messages = [{"role": "user", "content": sentence(rng, args.first_words)}]
    produced = 0
    for t in range(args.turns):
        try:
            ttft, reply, tokens = await turn(client, args.url, args.model, messages, args.output_len, headers)
        except (httpx.HTTPError, RuntimeError) as e:
            errors.append(repr(e)[:200])
            return produced
        ttfts[t].append(ttft)
        produced += tokens
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": sentence(rng, args.turn_words)}]
    if args.sessions:
        await client.delete(args.url + "/v1/sessions/" + headers["X-Session-Id"])
    return produced


async def run(args) -> dict:
    limits = httpx.Limits(max_connections=args.users + 16)
    ttfts: list[list[float]] = [[] for _ in range(args.turns)]
    errors: list[str] = []
    async with httpx.AsyncClient(timeout=1200, limits=limits) as client:
        start = time.perf_counter()
        produced = await asyncio.gather(*(user(i, client, args, ttfts, errors) for i in range(args.users)))
        wall = time.perf_counter() - start
    late = [x for t in ttfts[-2:] for x in t]
    return {
        "url": args.url, "users": args.users, "turns": args.turns, "sessions": args.sessions,
        "output_len": args.output_len, "duration_s": round(wall, 2), "failed": len(errors), "errors": errors[:3],
        "output_tokens": sum(produced), "output_tok_s": round(sum(produced) / wall, 2),
        "ttft_ms_by_turn": [summary(t) for t in ttfts],
        "ttft_ms_last_two_turns": summary(late),
        "ttft_ms_mean_all": round(statistics.fmean([x for t in ttfts for x in t]) * 1e3, 1) if any(ttfts) else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(ap)
    ap.add_argument("--sessions", action="store_true", help="one kvserve session per user (X-Session-Id)")
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--first-words", type=int, default=30, help="words in a user's first message")
    ap.add_argument("--turn-words", type=int, default=20, help="words in each later message")
    ap.add_argument("--output-len", type=int, default=48, help="reply tokens a turn")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.launch:
        with launched_server(args.model, args.serve_args.split()) as url:
            args.url = url
            report = asyncio.run(run(args))
            report["url"] = "launched"
    else:
        report = asyncio.run(run(args))
    print(json.dumps(report, indent=2))
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
