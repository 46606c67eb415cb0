"""Speculation over HTTP on the real model: drafts change no token, a row's logits never depend on its
step, seeded sampling is exact, and rolled-back drafts leave the pool exact."""
import asyncio
import json
import math
import secrets
import time
from collections import Counter

import httpx
import pytest

from server.config import EngineConfig
from server.engine.drafts import SpeculationConfig

from ..live_server import LiveServer, metric, metrics

MODEL = "smollm2-135m-instruct"
WIDE = EngineConfig(speculation=SpeculationConfig(max_rows=128))  # drafts even beside many streams
ACCEPTED = "kvserve:spec_decode_num_accepted_tokens_total"
PASSAGE = ("The lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
           "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone.")
DOCUMENT = json.dumps({"name": "Alice Martin", "age": 34, "city": "Paris", "skills": ["python", "sql", "statistics"]})
COPY = [
    "Repeat the following text exactly:\n\n" + PASSAGE,
    "Output this JSON document unchanged:\n\n" + DOCUMENT,
    "Copy these names, one per line:\n\nAnna Berg\nCarlos Diaz\nEmma Fischer\nGeorge Hall\nIrene Jones",
]


@pytest.fixture(scope="module")
def q4_server(served_model):
    with LiveServer(served_model, WIDE) as server:
        yield server


@pytest.fixture(scope="module")
def f32_server(smollm):
    with LiveServer(smollm, WIDE) as server:
        yield server


@pytest.fixture(scope="module")
def int16_server(smollm_path):
    """The served weights with `--activations int16` (the default is int8): other arithmetic, the same
    invariance."""
    from models import DEFAULT_MODEL, load_model

    with LiveServer(load_model(DEFAULT_MODEL, weights="auto", activations="int16"), WIDE) as server:
        yield server


def post_all(url: str, route: str, bodies: list[dict]) -> list[dict]:
    """The bodies sent at once -> their replies, in order."""
    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            replies = await asyncio.gather(*(client.post(url + route, json=b) for b in bodies))
        for r in replies:
            r.raise_for_status()
        return [r.json() for r in replies]
    return asyncio.run(go())


def chat(prompt: str, speculative: bool, max_tokens: int = 40, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": 2, "speculative": speculative, **extra}


def reply(res: dict) -> tuple:
    """A chat reply's text and every token's logprob and top logprobs, exactly."""
    c = res["choices"][0]
    return c["message"]["content"], [(t["token"], t["logprob"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
                                     for t in c["logprobs"]["content"]]


@pytest.mark.parametrize("which", ["q4_server", "f32_server", "int16_server"])
def test_drafts_change_no_greedy_token_alone_or_beside_8_streams(which, request):
    server = request.getfixturevalue(which)
    accepted = metric(server.url, ACCEPTED)
    off = [post_all(server.url, "/v1/chat/completions", [chat(p, False)])[0] for p in COPY]
    on = [post_all(server.url, "/v1/chat/completions", [chat(p, True)])[0] for p in COPY]
    assert [reply(r) for r in on] == [reply(r) for r in off]
    assert metric(server.url, ACCEPTED) > accepted + 10  # drafts were checked, and stood

    together = post_all(server.url, "/v1/chat/completions", [chat(COPY[i % 3], i % 2 == 0) for i in range(8)])
    for i, res in enumerate(together):
        assert reply(res) == reply(off[i % 3])


def test_a_rows_logits_do_not_depend_on_what_shares_its_step(fast_server):
    body = {"model": MODEL, "prompt": "The history of the city of Rome begins", "max_tokens": 24, "temperature": 0, "logprobs": 5}

    def fingerprint(res):
        c = res["choices"][0]
        return c["text"], c["logprobs"]["token_logprobs"], c["logprobs"]["top_logprobs"]

    alone = fingerprint(post_all(fast_server.url, "/v1/completions", [body])[0])
    for others in (1, 7, 31):
        extra = [dict(body, prompt=f"Story number {i}: once upon a time", max_tokens=30) for i in range(others)]
        got = post_all(fast_server.url, "/v1/completions", [body, *extra])[0]
        assert fingerprint(got) == alone, f"beside {others} others"


def test_seeded_choices_do_not_depend_on_the_prefix_cache_or_on_drafts(fast_server):
    body = {"model": MODEL, "prompt": f"[{secrets.token_hex(4)}] Three words about the sea:", "max_tokens": 16,
            "temperature": 0.9, "n": 3, "seed": 7}

    def choices(b):
        return [c["text"] for c in post_all(fast_server.url, "/v1/completions", [b])[0]["choices"]]

    hits = metric(fast_server.url, "kvserve:prefix_cache_hits_total")
    fresh, cached, again = choices(body), choices(body), choices(body)  # its prompt prefilled, then from the cache
    assert metric(fast_server.url, "kvserve:prefix_cache_hits_total") > hits
    assert fresh == cached == again and len(set(fresh)) > 1
    assert choices(dict(body, speculative=True)) == choices(dict(body, speculative=False)) == fresh


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.001 (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampling_with_drafts_draws_from_the_plain_distribution(q4_server):
    # seeded, so the run is fixed; 64 requests of n = 16 a side, with their own seeds
    def samples(speculative, first_seed):
        bodies = [{"model": MODEL, "prompt": COPY[0], "max_tokens": 3, "temperature": 0.8, "n": 16,
                   "seed": first_seed + 16 * j, "speculative": speculative} for j in range(64)]
        out = []
        for at in range(0, len(bodies), 8):
            out += [c["text"] for res in post_all(q4_server.url, "/v1/completions", bodies[at : at + 8]) for c in res["choices"]]
        return out

    accepted = metric(q4_server.url, ACCEPTED)
    on = samples(True, 0)
    assert metric(q4_server.url, ACCEPTED) > accepted  # drafts stood in the run
    assert samples(False, 0) == on  # the same seeds: the same tokens, drafts or not
    off = samples(False, 10**6)
    counts_on, counts_off = Counter(on), Counter(off)
    common = [t for t in counts_on.keys() | counts_off.keys() if counts_on[t] + counts_off[t] >= 10]
    cells = [(counts_on[t], counts_off[t]) for t in common]
    cells.append((len(on) - sum(a for a, _ in cells), len(off) - sum(b for _, b in cells)))  # the rare ones together
    cells = [c for c in cells if sum(c) > 0]
    assert len(cells) >= 3  # the continuation varies: the test can tell distributions apart
    total_on, total_off = len(on), len(off)
    stat = 0.0
    for a, b in cells:
        expected_a = (a + b) * total_on / (total_on + total_off)
        expected_b = (a + b) * total_off / (total_on + total_off)
        stat += (a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b
    assert stat < chi_square_critical(len(cells) - 1), (stat, cells)


def test_rolled_back_drafts_and_aborts_leave_the_pool_exact(q4_server):
    accepted = metric(q4_server.url, ACCEPTED)

    async def one(client, i):
        async with client.stream("POST", q4_server.url + "/v1/chat/completions",
                                 json=chat(COPY[i % 3], True, max_tokens=64, stream=True)) as r:
            events = 0
            async for line in r.aiter_lines():
                events += line.startswith("data: ")
                if i % 2 and events >= 6:
                    return  # half the clients hang up mid-reply, drafts in flight
    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            await asyncio.gather(*(one(client, i) for i in range(12)))
    asyncio.run(go())
    engine = q4_server.engine
    deadline = time.monotonic() + 60
    while engine.scheduler.has_work() and time.monotonic() < deadline:
        time.sleep(0.05)
    with engine.lock:
        assert not engine.scheduler.has_work()
        engine.pool.blocks.check()
        for s in engine.sessions:
            assert s.cached_length <= len(s.tokens)
    assert metric(q4_server.url, ACCEPTED) > accepted
    cancelled = [v for k, v in metrics(q4_server.url).items() if k.startswith("kvserve:request_success_total") and '"cancelled"' in k]
    assert sum(cancelled) >= 1


def test_drafts_keep_to_a_grammar_and_close_it_in_time(q4_server):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                                               "skills": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age", "city", "skills"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": schema, "strict": True}}
    accepted = metric(q4_server.url, ACCEPTED)
    for max_tokens in (80, 28):  # room to spare, and so little that the reply must close early
        off, on = (post_all(q4_server.url, "/v1/chat/completions", [chat(COPY[1], spec, max_tokens, response_format=fmt)])[0]
                   for spec in (False, True))
        assert reply(on) == reply(off)
        assert on["choices"][0]["finish_reason"] == "stop"
        assert set(json.loads(on["choices"][0]["message"]["content"])) == set(schema["properties"])
    assert metric(q4_server.url, ACCEPTED) > accepted  # drafts stood inside the grammar
