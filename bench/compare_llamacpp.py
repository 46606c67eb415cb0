"""One stream, same GGUF, same window: llama.cpp (llama-cpp-python, in process) against kvserve over HTTP.

    pip install llama-cpp-python==0.3.36   # builds llama.cpp from source (about 10 minutes on 2 cores)
    python bench/compare_llamacpp.py [--rounds 5] [--tokens 128] [--threads 2]

This machine's speed drifts by a quarter within minutes, so the two engines take turns, round by
round, and the ratio of their medians is the figure to read. Each round decodes --tokens greedy tokens
from the same prompt; the decode rate excludes the prompt (tokens after the first / time after it).
Prints JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time

import httpx

from launch import launched_server
from models import DEFAULT_MODEL
from models.catalog import fetch
from serve_bench import one

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def llamacpp_round(llm, prompt_tokens: list[int], n_tokens: int) -> float:
    """Decode tok/s of one greedy generation (llama.cpp keeps no state between rounds after reset)."""
    llm.reset()
    stamps = []
    for _ in llm.generate(prompt_tokens, top_k=1, temp=0.0, reset=True):
        stamps.append(time.perf_counter())
        if len(stamps) == n_tokens:
            break
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def kvserve_round(url: str, n_tokens: int) -> float:
    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            return await one(client, url, DEFAULT_MODEL, PROMPT, n_tokens)

    r = asyncio.run(go())
    if not r.ok:
        raise RuntimeError(f"kvserve request failed: {r.error}")
    return (r.output_tokens - 1) / (r.e2e - r.ttft)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--serve-args", default="", help="extra arguments for the launched kvserve")
    args = ap.parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        print(json.dumps({"error": "llama-cpp-python is not installed: pip install llama-cpp-python==0.3.36"}))
        raise SystemExit(2)
    gguf = fetch(DEFAULT_MODEL, quiet=True)
    llm = Llama(model_path=str(gguf), n_threads=args.threads, n_ctx=1024, verbose=False)
    prompt_tokens = llm.tokenize(PROMPT.encode())
    rates: dict[str, list[float]] = {"llama.cpp": [], "kvserve": []}
    with launched_server(DEFAULT_MODEL, args.serve_args.split()) as url:
        kvserve_round(url, 8)  # first request: route set-up, not decoding
        llamacpp_round(llm, prompt_tokens, 8)
        for _ in range(args.rounds):
            rates["llama.cpp"].append(llamacpp_round(llm, prompt_tokens, args.tokens))
            rates["kvserve"].append(kvserve_round(url, args.tokens))
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({
        "model": DEFAULT_MODEL, "gguf": gguf.name, "machine": platform.processor() or platform.machine(),
        "threads_llama_cpp": args.threads, "tokens": args.tokens,
        "decode_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "median_tok_s": {k: round(v, 1) for k, v in med.items()},
        "kvserve_over_llama_cpp": round(med["kvserve"] / med["llama.cpp"], 3),
    }, indent=2))


if __name__ == "__main__":
    main()
