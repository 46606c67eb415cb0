"""How often constrained JSON parses and matches its schema, at a given max_tokens, on any OpenAI server.

    python bench/json_parse_rate.py --launch                       # a local kvserve
    python bench/json_parse_rate.py --url http://127.0.0.1:8080    # llama-server, vLLM, ...

Each of 20 prompts is sent greedy twice per max_tokens: with `response_format: json_object`, and with
`json_schema` and the prompt's own schema. A reply counts when its content parses (and, for a schema,
validates). Also counted: replies that finish `length`, and the output tokens a second over each set
(with --concurrency 32 that is the cost of the constraint under load). Prints JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx
import jsonschema

from launch import add_target_args, launched_server


def obj(required: dict, **extra) -> dict:
    return {"type": "object", "properties": required, "required": list(required), **extra}


S, I, N, B = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
STRINGS = {"type": "array", "items": S}
PROMPTS = [
    ("Describe a cat as JSON.", obj({"name": S, "color": S, "age": I})),
    ("Give me a JSON list of three fruits with colors.", obj({"fruits": {"type": "array", "items": obj({"name": S, "color": S})}})),
    ("JSON for a book: title, year.", obj({"title": S, "year": I})),
    ("Return a JSON object describing the weather in Paris.", obj({"city": S, "temperature": N, "sky": S})),
    ("Write a JSON recipe for pancakes with ingredients and steps.", obj({"name": S, "ingredients": STRINGS, "steps": STRINGS})),
    ("Give a JSON profile of a fictional person.", obj({"name": S, "age": I, "city": S, "hobbies": STRINGS})),
    ("As JSON, list the planets of the solar system.", obj({"planets": STRINGS})),
    ("Describe a car in JSON with make, model and year.", obj({"make": S, "model": S, "year": I})),
    ("Output JSON with a movie title, director and rating.", obj({"title": S, "director": S, "rating": N})),
    ("Make a JSON shopping list with quantities.", obj({"items": {"type": "array", "items": obj({"item": S, "quantity": I})}})),
    ("Give the capital cities of France, Spain and Italy as JSON.", obj({"France": S, "Spain": S, "Italy": S})),
    ("Return a JSON object for a user account: username, email, active.", obj({"username": S, "email": S, "active": B})),
    ("Describe a dog breed as JSON.", obj({"breed": S, "size": S, "traits": STRINGS})),
    ("Produce a JSON event with a name, date and location.", obj({"name": S, "date": S, "location": S})),
    ("JSON for a song: artist, title, length in seconds.", obj({"artist": S, "title": S, "seconds": I})),
    ("Write a JSON todo list with three tasks and whether each is done.",
     obj({"tasks": {"type": "array", "items": obj({"task": S, "done": B})}})),
    ("Give a JSON summary of the water cycle.", obj({"stages": STRINGS, "summary": S})),
    ("Return JSON describing a laptop's specs.", obj({"brand": S, "cpu": S, "ram_gb": I, "storage_gb": I})),
    ("As JSON, give three colors with their hex codes.", obj({"colors": {"type": "array", "items": obj({"name": S, "hex": S})}})),
    ("Describe your favorite city as a JSON object with nested details.",
     obj({"city": S, "country": S, "details": obj({"population": I, "famous_for": STRINGS})})),
]


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, schema: dict | None, max_tokens: int) -> dict:
    fmt = ({"type": "json_object"} if schema is None
           else {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    r = await client.post(f"{url}/v1/chat/completions", json={
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0, "response_format": fmt})
    if r.status_code != 200:
        return {"ok": False, "length": False, "status": r.status_code, "tokens": 0}
    choice = r.json()["choices"][0]
    ok = True
    try:
        value = json.loads(choice["message"]["content"])
        if schema is not None:
            jsonschema.validate(value, schema)
        elif not isinstance(value, dict):
            ok = False
    except (json.JSONDecodeError, TypeError, jsonschema.ValidationError):
        ok = False
    return {"ok": ok, "length": choice["finish_reason"] == "length", "status": 200,
            "tokens": r.json()["usage"]["completion_tokens"]}


async def run(url: str, model: str, limits: list[int], kinds: list[str], concurrency: int) -> dict:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as client:
        async def gated(*a):
            async with gate:
                return await one(client, url, model, *a)

        out = {}
        for limit in limits:
            for kind in kinds:
                start = time.perf_counter()
                results = await asyncio.gather(*(gated(p, None if kind == "json_object" else s, limit) for p, s in PROMPTS))
                seconds = time.perf_counter() - start
                out[f"{kind}@{limit}"] = {
                    "output_tok_s": round(sum(r["tokens"] for r in results) / seconds, 1),
                    "parsed": sum(r["ok"] for r in results), "of": len(results),
                    "finished_length": sum(r["length"] for r in results),
                    "http_errors": sum(r["status"] != 200 for r in results),
                }
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    add_target_args(ap)
    ap.add_argument("--max-tokens", default="60,120,400")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--kinds", default="json_object,json_schema")
    args = ap.parse_args()
    limits = [int(x) for x in args.max_tokens.split(",")]
    kinds = args.kinds.split(",")
    if args.launch:
        with launched_server(args.model, args.serve_args.split()) as url:
            result = asyncio.run(run(url, args.model, limits, kinds, args.concurrency))
    else:
        result = asyncio.run(run(args.url, args.model, limits, kinds, args.concurrency))
    print(json.dumps({"url": "launched" if args.launch else args.url, "results": result}, indent=1))


if __name__ == "__main__":
    main()
