"""N-gram speculation: decode tokens/s with drafts on and off, on copy-heavy and free-text prompts, beside
llama-server with and without its own n-gram speculation. Prints JSON.

    python bench/speculation.py --llama-server PATH/llama-server [--gguf FILE] [--rounds 3] [--streams 1,32]
                                [--widened-1b]

--widened-1b serves both sides a model that reads as many bytes a token as Llama-3.2-1B and still copies:
SmolLM2-135M widened with zeros, as Q4_K_M (bench/load_models.py), since random weights never copy.

One kvserve (`--speculative ngram`; each request sets `speculative` on or off) and two llama-servers
(`-t 2 --cont-batching --jinja`, `-np` the most --streams asks for, plain and `--spec-type ngram-simple`)
run side by side.
Every prompt goes to each target in turn, greedy and streamed, and a round repeats the set. A request's
decode rate is its tokens after the first over the time since the first, its end-to-end rate all its
tokens over its whole time (the prefill's included); a set's figure is the median over its requests and
rounds. With 32 streams the whole set runs
at once, 32 requests, copy-heavy and free text mixed, and the figure is all tokens over the wall time.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launch import launched_server  # noqa: E402
from llama_server import llama_server  # noqa: E402

PASSAGE = ("The lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
           "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships far out at "
           "sea saw the beam sweep across the water and knew that the rocks were near. When the keeper grew old, his "
           "daughter took his place, and she kept the light burning through storms, fog and the longest winters.")
TYPOS = ("Yesterday we went to the libary to return some bookes. The librarian was very frendly and helpped us find "
         "a new novle about a detective who solves misteries in an old castle. We also borowed two magazines and a "
         "cookbook with recipies for bread, soup and chocolate cake. On the way home it started to rain, so we "
         "stoped at a cafe and drank hot chocolat until the wether got better.")
CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, email = line.strip().split(",")
            users.append({"name": name, "age": int(age), "email": email})
    return users


def oldest(users):
    best = None
    for user in users:
        if best is None or user["age"] > best["age"]:
            best = user
    return best


def emails(users, domain):
    return [u["email"] for u in users if u["email"].endswith("@" + domain)]
'''
DOCUMENT = json.dumps({"name": "Alice Martin", "age": 34, "city": "Paris", "email": "alice@example.com",
                       "skills": ["python", "sql", "statistics"], "address": {"street": "12 Rue de Rivoli", "zip": "75001"},
                       "projects": [{"title": "Sales dashboard", "year": 2023}, {"title": "Churn model", "year": 2024}]}, indent=2)
COPY = [
    "Repeat the following passage exactly, word for word:\n\n" + PASSAGE,
    "Fix the spelling mistakes in this text. Output only the corrected text.\n\n" + TYPOS,
    "Add type hints to this Python code. Output only the code.\n\n" + CODE,
    'Here is a JSON document. Change "city" to "Berlin" and output the whole document.\n\n' + DOCUMENT,
]
# decode: a request's tokens after the first over the time since the first; end to end: all its tokens
# over its whole time, the prefill's included
KINDS = ("copy", "copy end to end", "free", "free end to end")
MODEL = [""]  # the name requests give: kvserve's served name (it checks it; llama-server takes any)
FREE = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, for a ten-year-old.",
    "What are the benefits of regular exercise? Answer in a paragraph.",
    "Describe a day in the life of a medieval blacksmith.",
]


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    # Every request starts cold, its prompt's KV cached nowhere: kvserve's prefix cache is salted apart for it,
    # and llama-server's slot cache is off. Else whichever target asked second would skip its prefill.
    cold = {"cache_salt": uuid.uuid4().hex} if "speculative" in extra else {"cache_prompt": False}
    body = {"model": MODEL[0], "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra, **cold}
    start, first, last, chunks, usage, text = time.perf_counter(), None, None, 0, None, []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            usage = data.get("usage") or usage
            for choice in data.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                    text.append(piece)
    tokens = usage["completion_tokens"] if usage else chunks
    decode = (tokens - 1) / (last - first) if first is not None and last > first and tokens > 1 else None
    return {"tokens": tokens, "ttft_s": (first or time.perf_counter()) - start, "decode_tok_s": decode,
            "wall_s": time.perf_counter() - start, "text": "".join(text)}


async def one_stream(targets: dict, rounds: int, max_tokens: int) -> dict:
    rates: dict[str, dict[str, list[float]]] = {name: {k: [] for k in KINDS} for name in targets}
    same = []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(rounds):
            for kind, prompts in (("copy", COPY), ("free", FREE)):
                for prompt in prompts:
                    texts = {}
                    for name, (url, extra) in targets.items():
                        got = await stream(client, url, prompt, max_tokens, extra)
                        texts[name] = got["text"]
                        if got["decode_tok_s"] is not None:
                            rates[name][kind].append(got["decode_tok_s"])
                        rates[name][f"{kind} end to end"].append(got["tokens"] / got["wall_s"])
                    same.append(texts["kvserve ngram"] == texts["kvserve off"])
    out = {name: {kind: round(statistics.median(v), 1) if v else None for kind, v in by.items()} for name, by in rates.items()}
    kv_on, kv_off = out["kvserve ngram"], out["kvserve off"]
    ratios = {f"{kind}: ngram / off": kv_on[kind] / kv_off[kind] for kind in KINDS}
    for name in targets:
        if name.startswith("llama-server"):
            ratios |= {f"{kind}: kvserve ngram / {name}": kv_on[kind] / out[name][kind] for kind in KINDS}
    return {"tok_s_median": out, "ratios": {k: round(v, 2) for k, v in ratios.items()},
            "kvserve greedy text identical on/off": f"{sum(same)}/{len(same)}"}


async def many_streams(targets: dict, rounds: int, max_tokens: int, streams: int) -> dict:
    prompts = [(COPY + FREE)[i % (len(COPY) + len(FREE))] for i in range(streams)]
    rates: dict[str, list[float]] = {name: [] for name in targets}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=streams + 4)) as client:
        for _ in range(rounds):
            for name, (url, extra) in targets.items():
                start = time.perf_counter()
                got = await asyncio.gather(*(stream(client, url, p, max_tokens, extra) for p in prompts))
                rates[name].append(sum(g["tokens"] for g in got) / (time.perf_counter() - start))
    out = {name: round(statistics.median(v), 1) for name, v in rates.items()}
    return {"output_tok_s_median": out, "runs": {k: [round(x, 1) for x in v] for k, v in rates.items()},
            "ngram / off": round(out["kvserve ngram"] / out["kvserve off"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary to run beside kvserve")
    ap.add_argument("--gguf", default=None, help="the GGUF llama-server loads (default: the model's cached file)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--widened-1b", action="store_true", help="SmolLM2 widened to a 1B's reads, Q4_K_M, on both sides")
    args = ap.parse_args()
    if args.widened_1b:
        from load_models import copying_model_file
        args.model = args.gguf = str(copying_model_file("Q4_K_M"))
    gguf = args.gguf
    if args.llama_server and gguf is None:
        from models.catalog import fetch
        gguf = str(fetch(args.model))
    result = {"model": args.model, "rounds": args.rounds, "max_tokens": args.max_tokens}
    with contextlib.ExitStack() as stack:
        kv = stack.enter_context(launched_server(args.model, ["--speculative", "ngram"]))
        MODEL[0] = httpx.get(kv + "/v1/models").json()["data"][0]["id"]  # a file's name is its stem
        targets = {"kvserve ngram": (kv, {"speculative": True}), "kvserve off": (kv, {"speculative": False})}
        levels = [int(x) for x in args.streams.split(",")]
        if args.llama_server:
            slots = max(levels)
            targets["llama-server"] = (stack.enter_context(llama_server(args.llama_server, gguf, [], slots=slots)), {})
            targets["llama-server ngram-simple"] = (
                stack.enter_context(llama_server(args.llama_server, gguf, ["--spec-type", "ngram-simple"], slots=slots)), {})
        for n in levels:
            if n == 1:
                result["1 stream"] = asyncio.run(one_stream(targets, args.rounds, args.max_tokens))
            else:
                result[f"{n} streams"] = asyncio.run(many_streams(targets, args.rounds, args.max_tokens, n))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
