"""Lone surrogates, numbers past a double's range and odd types get a 400 in the route's own error shape on
every route that takes a body, never a 500 (issue 67: /v1/embeddings answered "hi \\ud800 there" with a
500 TypeError from the tokenizer)."""
import json

import httpx
import pytest

from models import load_model
from server.config import EngineConfig

from ..live_server import LiveServer

BAD = "\u0000BAD\u0000"  # where each case's raw JSON goes
SURROGATE, HUGE_FLOAT, HUGE_INT = '"hi \\ud800 there"', "1e400", "1" + "0" * 400
USER = [{"role": "user", "content": "hi"}]


def user(content):
    return [{"role": "user", "content": content}]


def free(body: dict) -> dict:
    """A body whose BAD is a free-form value (a tool's arguments or parameters): any JSON is fine there but
    a lone surrogate or a number past a double's range."""
    return {**body, FREE: True}


FREE = "free-form"
# route -> bodies, each with BAD where a case puts its value: the strings each route tokenizes (prompt,
# messages, system, tool arguments), a bounded number, and a free-form value (a tool's parameters)
SLOTS = {
    "/generate": [{"inputs": BAD}, {"inputs": "hi", "parameters": {"max_new_tokens": BAD}}],
    "/generate_stream": [{"inputs": BAD}],
    "/v1/completions": [{"prompt": BAD, "max_tokens": 2}, {"prompt": "hi", "max_tokens": BAD}, {"prompt": [BAD], "max_tokens": 2}],
    "/v1/chat/completions": [
        {"messages": user(BAD), "max_tokens": 2},
        {"messages": [{"role": "system", "content": BAD}, *USER], "max_tokens": 2},
        {"messages": [*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": BAD}}]}, {"role": "tool", "tool_call_id": "c", "content": "ok"}], "max_tokens": 2},
        free({"messages": USER, "max_tokens": 2, "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "string", "default": BAD}}}}}]}),
        {"messages": USER, "max_tokens": BAD},
    ],
    "/v1/responses": [{"input": BAD, "max_output_tokens": 2}, {"input": "hi", "instructions": BAD, "max_output_tokens": 2},
                      free({"input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", "name": "f", "parameters": {
                          "type": "object", "properties": {"a": {"type": "string", "default": BAD}}}}]})],
    "/v1/messages": [{"model": "tiny", "max_tokens": 2, "messages": user(BAD)},
                     {"model": "tiny", "max_tokens": 2, "system": BAD, "messages": USER},
                     free({"model": "tiny", "max_tokens": 2, "messages": [*USER, {"role": "assistant", "content": [
                         {"type": "tool_use", "id": "t", "name": "f", "input": {"a": BAD}}]}]}),
                     {"model": "tiny", "max_tokens": BAD, "messages": USER}],
    "/v1/messages/count_tokens": [{"model": "tiny", "messages": user(BAD)}],
    "/api/chat": [{"model": "tiny", "messages": user(BAD), "stream": False},
                  free({"model": "tiny", "messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
                      {"function": {"name": "f", "arguments": {"a": BAD}}}]}], "stream": False}),
                  {"model": "tiny", "messages": USER, "stream": False, "options": {"num_predict": BAD}}],
    "/api/generate": [{"model": "tiny", "prompt": BAD, "stream": False}, {"model": "tiny", "prompt": "hi", "system": BAD, "stream": False}],
    "/v1/embeddings": [{"input": BAD}, {"input": [BAD]}, {"input": "hi", "dimensions": BAD}],
    "/api/embed": [{"model": "tiny", "input": BAD}, {"model": "tiny", "input": "hi", "dimensions": BAD}],
    "/api/embeddings": [{"model": "tiny", "prompt": BAD}],
    "/tokenize": [{"prompt": BAD}, {"messages": user(BAD)}],
    "/detokenize": [{"tokens": [1, BAD]}],
    "/v1/chat/completions/render": [{"messages": user(BAD)}],
    "/v1/completions/render": [{"prompt": BAD}],
    "/api/show": [{"model": BAD}],
    "/v1/sessions": [{"capacity": BAD}],
    "/v1/sessions/{session_id}/rewind": [{"length": BAD}],
    "/v1/sessions/{session_id}/fork": [{"id": BAD}],
    "/v1/sessions/{session_id}/snapshot": [free({"ignored": BAD})],  # it reads no body: only JSON's own checks
}
ODD_TYPES = ["{}", "[[]]", "[true]", '{"a": [1, {"b": null}]}']
CASES = [(path, n, value) for path, bodies in SLOTS.items() for n, body in enumerate(bodies)
         for value in ((SURROGATE, HUGE_FLOAT) if body.get(FREE) else (SURROGATE, HUGE_FLOAT, HUGE_INT, *ODD_TYPES))]


@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoints):
    with LiveServer(load_model(str(tiny_checkpoints["llama"])), EngineConfig(session_capacity=256), name="tiny") as server:
        yield server


@pytest.fixture(scope="module")
def session_id(tiny_server):
    return httpx.post(tiny_server.url + "/v1/sessions", json={}).json()["id"]


def raw_body(body: dict, value: str) -> bytes:
    body = {k: v for k, v in body.items() if k != FREE}
    return json.dumps(body).replace(json.dumps(BAD), value).encode()


def assert_dialect_error(path: str, body: dict) -> str:
    """The error's message, once the body is in the route's dialect's shape."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"]
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"]
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"]


def test_every_route_with_a_body_is_covered(tiny_server):
    """A route added later without cases here would escape this file."""
    paths = httpx.get(tiny_server.url + "/openapi.json").json()["paths"]
    assert {path for path, ops in paths.items() if "post" in ops} <= set(SLOTS)


@pytest.mark.parametrize("path,slot,value", CASES)
def test_unusable_values_get_a_400_in_the_dialect_shape(tiny_server, session_id, path, slot, value):
    r = httpx.post(tiny_server.url + path.replace("{session_id}", session_id), content=raw_body(SLOTS[path][slot], value),
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    message = assert_dialect_error(path, r.json())
    if value == SURROGATE:
        assert "surrogate" in message or "unicode" in message.lower(), message
    if value == HUGE_FLOAT:
        assert "range" in message or "less than" in message or "finite" in message, message


def test_a_valid_surrogate_pair_is_text(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/embeddings", content=b'{"input": "hi \\ud83d\\ude00 there"}',
                   headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.post(tiny_server.url + "/tokenize", json={"prompt": "hi \U0001F600"}).json()["count"] > 0
