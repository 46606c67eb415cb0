"""Every generation, embedding and utility route of every dialect, driven by hypothesis with generated bodies
against a live server: a valid body for the route with some of its fields (or new ones) replaced by hostile
values (deep nesting, lone surrogates, numbers past any float, odd types, the grammars and schemas that
once crashed or froze the server), and now and then a raw body that is not JSON at all.

Asserted: no 5xx and no dropped connection for any body, /health answering quickly throughout (a thread polls
it for the whole run), and the KV pool back at its baseline once every reply has ended."""
import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models import load_model
from server.config import EngineConfig

from ..live_server import HealthWatch, LiveServer, metric
from .test_constraint_budgets import PARENS, RULE_CHAIN, nested_object

USER = [{"role": "user", "content": "hi"}]
# a valid body for each route: what a mutation starts from, so bodies reach past the schema's first check
ROUTES = {
    "/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
    "/generate_stream": {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/completions/render": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/chat/completions/render": {"messages": USER},
    "/v1/responses": {"input": "hi", "max_output_tokens": 2, "store": False},
    "/v1/messages": {"model": "tiny", "max_tokens": 2, "messages": USER},
    "/v1/messages/count_tokens": {"model": "tiny", "messages": USER},
    "/api/chat": {"model": "tiny", "messages": USER, "stream": False, "options": {"num_predict": 2}},
    "/api/generate": {"model": "tiny", "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
    "/api/embed": {"model": "tiny", "input": "hi"},
    "/api/embeddings": {"model": "tiny", "prompt": "hi"},
    "/api/show": {"model": "tiny"},
    "/v1/embeddings": {"input": "hi"},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
# fields each dialect reads, beside each route's own: a mutation picks one of these or the route's keys
FIELDS = ["messages", "prompt", "input", "inputs", "content", "system", "tools", "tool_choice", "response_format",
          "guided_json", "guided_regex", "guided_grammar", "grammar", "guided_choice", "format", "options",
          "parameters", "stop", "max_tokens", "temperature", "logit_bias", "keep_alive", "seed", "n", "thinking",
          "text", "instructions", "stream", "logprobs", "top_logprobs", "model", "tokens", "think", "metadata"]
SESSION_FIELDS = {"store", "session_id", "previous_response_id"}  # left alone: a kept session holds KV by design


def deep(depth: int, leaf=0):
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


HOSTILE = st.sampled_from([
    "hi \ud800 there", "\udfff", "\x00", "a" * 100_000, 10**400, -(10**400), 1e308, 2**63, -1, 0, None, True,
    [], {}, [None], deep(400), nested_object(420), RULE_CHAIN, PARENS, "1" * 25_000 + "x",
    "(" * 200 + "a" + ")" * 200, {"type": "objekt"}, [{"role": "user", "content": deep(300)}],
    [{"type": "function", "function": {"name": "f", "parameters": nested_object(420)}}],
    {"type": "json_schema", "json_schema": {"name": "n", "schema": nested_object(420)}},
])
JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40)
VALUES = HOSTILE | st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4) |
                                st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=20)
RAW = st.sampled_from([b'{"messages": ', b"[" * 100_000, b"\xff\xfe", b"null", b'"x"', b"{}" * 10,
                       b'{"prompt": "\\ud800"}', b'{"max_tokens": 1e400}', b'{"a": NaN}',
                       b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"])


@st.composite
def bodies(draw):
    path = draw(st.sampled_from(sorted(ROUTES)))
    if draw(st.integers(0, 9)) == 0:
        return path, draw(RAW)
    body = json.loads(json.dumps(ROUTES[path]))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(set(body) | set(FIELDS))))
        if key not in SESSION_FIELDS:
            body[key] = draw(VALUES)
    return path, json.dumps(body).encode()  # json.dumps writes a lone surrogate as its \u escape, as clients do


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    model = load_model(str(tiny_checkpoints["llama"]))
    # a short context keeps every reply a fuzzed body asks for short
    with LiveServer(model, EngineConfig(max_model_len=48, constraint_timeout=2.0), name="tiny") as s:
        yield s


def test_generated_bodies_on_every_route_never_get_a_5xx(server):
    baseline = metric(server.url, "kvserve:kv_cache_usage_bytes")
    seen: dict[int, int] = {}
    with HealthWatch(server.url) as watch, httpx.Client(base_url=server.url, timeout=120) as client:
        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(bodies())
        def one(case):
            path, raw = case
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            r.read()
            seen[r.status_code] = seen.get(r.status_code, 0) + 1
            assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:500])

        one()
    assert watch.failures == 0, f"{watch.failures} /health polls failed"
    assert watch.slowest < 0.5, f"/health took {watch.slowest:.3f} s during the run"
    assert seen.get(200, 0) > 0 and seen.get(400, 0) > 0, seen  # both valid and refused bodies were sent
    deadline = time.monotonic() + 30
    while metric(server.url, "kvserve:kv_cache_usage_bytes") != baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server.url, "kvserve:kv_cache_usage_bytes") == baseline
