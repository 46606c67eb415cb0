"""Serving benchmark for any OpenAI-compatible server (kvserve, vLLM, llama.cpp's llama-server, TGI).

    python bench/serve_bench.py --url http://127.0.0.1:8000 --concurrency 1,8,32 --num-prompts 64
    python bench/serve_bench.py --launch --concurrency 1,8,32 --plot results   # starts kvserve itself
    python bench/serve_bench.py --url ... --rate 4 --num-prompts 100            # Poisson arrivals
    python bench/serve_bench.py --launch --concurrency 32 --json-fraction 0.5   # plain, then half JSON-schema

Streams /v1/completions. Prompt and output lengths come from a seeded distribution. Prints JSON:
completed and failed requests, request throughput, output tok/s, and TTFT, TPOT, ITL and end-to-end
latency (mean, p50, p90, p99, in ms) for each concurrency level (or rate). With --json-fraction, each
level runs twice in the same server, plain and then with that fraction of requests constrained to a JSON
schema (`response_format`), and reports TPOT of the constrained and unconstrained requests apart.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from launch import add_target_args, launched_server  # noqa: E402

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river mountain city music science story").split()


# What the constrained requests must produce: twelve short strings, so replies run about as long as plain ones.
JSON_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
    "items": {"type": "array", "minItems": 12, "maxItems": 12, "items": {"type": "string", "minLength": 3, "maxLength": 16}}}}


@dataclass
class Result:
    ok: bool
    constrained: bool = False
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


def make_requests(n: int, input_len: int, output_len: int, spread: float, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)

    def around(mean):
        return max(1, int(rng.uniform(mean * (1 - spread), mean * (1 + spread))))

    return [(" ".join(rng.choice(WORDS) for _ in range(around(input_len))), around(output_len)) for _ in range(n)]


async def sse_events(response: httpx.Response):
    """The JSON events of a streamed OpenAI response, until [DONE]."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
              constrained: bool = False) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "list", "schema": JSON_SCHEMA}}
    start = time.perf_counter()
    last, res, chunks = None, Result(ok=False, constrained=constrained), 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"{r.status_code}: {(await r.aread())[:200]!r}")
            async for event in sse_events(r):
                if event.get("usage"):
                    res.output_tokens = event["usage"]["completion_tokens"]
                if not event.get("choices") or not event["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
    except httpx.HTTPError as e:
        return Result(ok=False, error=repr(e))
    res.e2e = time.perf_counter() - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = True
    return res


def summary(values: list[float]) -> dict:
    if not values:
        return {}
    s = sorted(values)

    def pct(p):
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))] * 1e3

    return {"mean": round(statistics.fmean(s) * 1e3, 2), "p50": round(pct(50), 2), "p90": round(pct(90), 2), "p99": round(pct(99), 2)}


async def run_level(url, model, requests, concurrency: int | None, rate: float | None, seed: int,
                    json_fraction: float = 0.0) -> dict:
    limits = httpx.Limits(max_connections=max(64, concurrency or 0) + 16)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        gate = asyncio.Semaphore(concurrency or len(requests))
        rng = random.Random(seed)

        async def guarded(prompt, n, constrained):
            async with gate:
                return await one(client, url, model, prompt, n, constrained)

        start = time.perf_counter()
        tasks = []
        for i, (prompt, n) in enumerate(requests):
            constrained = int((i + 1) * json_fraction) > int(i * json_fraction)  # that fraction, evenly spread
            tasks.append(asyncio.create_task(guarded(prompt, n, constrained)))
            if rate:
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    by_kind = {}
    if json_fraction:
        for kind, want in (("constrained", True), ("unconstrained", False)):
            group = [r for r in ok if r.constrained == want and r.output_tokens > 1]
            by_kind[kind] = {"requests": len(group), "output_tokens": sum(r.output_tokens for r in group),
                             "tpot_ms": summary([(r.e2e - r.ttft) / (r.output_tokens - 1) for r in group])}
    return {
        "json_fraction": json_fraction, **({"tpot_by_kind": by_kind} if by_kind else {}),
        "concurrency": concurrency, "rate": rate, "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3],
        "duration_s": round(wall, 2), "request_throughput": round(len(ok) / wall, 3),
        "output_tokens": out_tokens, "output_tok_s": round(out_tokens / wall, 2),
        "ttft_ms": summary([r.ttft for r in ok]), "tpot_ms": summary(tpot),
        "itl_ms": summary([x for r in ok for x in r.itl]), "e2e_ms": summary([r.e2e for r in ok]),
        "_itl_raw": [x for r in ok for x in r.itl], "_ttft_raw": [r.ttft for r in ok],
    }


def plot(levels: list[dict], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    xs = [lv["concurrency"] or lv["rate"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [lv["output_tok_s"] for lv in levels], marker="o")
    ax.set_xlabel("concurrent streams" if levels[0]["concurrency"] else "request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "throughput.png", dpi=120)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for lv, x in zip(levels, xs):
        a1.hist([v * 1e3 for v in lv["_ttft_raw"]], bins=30, alpha=0.5, label=str(x))
        a2.hist([v * 1e3 for v in lv["_itl_raw"]], bins=50, alpha=0.5, label=str(x))
    a1.set_title("time to first token (ms)")
    a2.set_title("inter-token latency (ms)")
    for a in (a1, a2):
        a.legend(title="concurrency" if levels[0]["concurrency"] else "rate")
    fig.tight_layout()
    fig.savefig(folder / "latency.png", dpi=120)
    return [str(folder / "throughput.png"), str(folder / "latency.png")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_target_args(ap)
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated levels (ignored with --rate)")
    ap.add_argument("--rate", type=float, default=None, help="Poisson arrivals at this many requests/s")
    ap.add_argument("--num-prompts", type=int, default=0, help="requests per level (default 2x the level, at least 8)")
    ap.add_argument("--input-len", type=int, default=64, help="mean prompt length in words")
    ap.add_argument("--output-len", type=int, default=64, help="mean output tokens")
    ap.add_argument("--spread", type=float, default=0.25, help="lengths vary uniformly by this fraction")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default=None, help="folder for throughput.png and latency.png")
    ap.add_argument("--json-fraction", type=float, default=0.0,
                    help="also run each level with this fraction of requests constrained to a JSON schema")
    args = ap.parse_args()

    async def run(url):
        levels = [None] if args.rate else [int(c) for c in args.concurrency.split(",")]
        out = []
        for c in levels:
            n = args.num_prompts or max(8, 2 * (c or 8))
            reqs = make_requests(n, args.input_len, args.output_len, args.spread, args.seed)
            await run_level(url, args.model, reqs[:1], 1, None, args.seed)  # warm-up
            out.append(await run_level(url, args.model, reqs, c, args.rate, args.seed))
            if args.json_fraction:
                out.append(await run_level(url, args.model, reqs, c, args.rate, args.seed, args.json_fraction))
        return out

    if args.launch:
        with launched_server(args.model, args.serve_args.split()) as url:
            levels = asyncio.run(run(url))
    else:
        levels = asyncio.run(run(args.url))
    charts = plot(levels, Path(args.plot)) if args.plot else []
    report = {"url": "launched" if args.launch else args.url, "model": args.model, "input_len": args.input_len,
              "output_len": args.output_len, "levels": [{k: v for k, v in lv.items() if not k.startswith("_")} for lv in levels]}
    if len(levels) > 1 and levels[0]["output_tok_s"]:
        report["scaling_vs_first_level"] = round(levels[-1]["output_tok_s"] / levels[0]["output_tok_s"], 2)
    if charts:
        report["charts"] = charts
    print(json.dumps(report, indent=2))
    return 0 if all(lv["failed"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
