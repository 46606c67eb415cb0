"""Fields read by a scanner or a regex take time linear in what the client sent: a long hostile value gets
its answer quickly, and /health answers meanwhile (issue 67: a 25,000-digit keep_alive held the event loop
for 33 s in a backtracking regex)."""
import json
import re
import time

import httpx
import pytest

from models import load_model
from server.api.durations import duration_seconds
from server.api.tools import parse_tool_calls
from server.config import EngineConfig

from ..live_server import HealthWatch, LiveServer


@pytest.fixture(scope="module")
def tiny_server(tiny_checkpoints):
    with LiveServer(load_model(str(tiny_checkpoints["llama"])), EngineConfig(session_capacity=64), name="tiny") as server:
        yield server


@pytest.mark.parametrize("keep_alive", ["1" * 25000 + "x", "1" * 25000, "." * 25000 + "s", "1m" * 12500 + "x"])
def test_a_huge_keep_alive_is_refused_quickly_while_health_answers(tiny_server, keep_alive):
    url = tiny_server.url
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "keep_alive": keep_alive, "stream": False}
    with HealthWatch(url) as poller:
        time.sleep(0.2)  # the poller is under way before the request arrives
        start = time.perf_counter()
        r = httpx.post(url + "/api/chat", json=body, timeout=120)
        took = time.perf_counter() - start
        time.sleep(0.2)
    assert r.status_code == 400, r.text
    assert "keep_alive" in r.json()["error"] and "duration" in r.json()["error"]
    assert took < 5, f"the refusal took {took:.1f} s"
    assert poller.polls >= 5 and poller.failures == 0
    assert poller.slowest < 0.75, f"/health took up to {poller.slowest:.2f} s"


@pytest.mark.parametrize("keep_alive,unloads", [
    ("0", True), ("0s", True), ("-0m0s", True), (" 0 ", True), ("5m", False), ("1h30m", False), ("1.5s", False),
    (".5ms", False), ("5.us", False), ("+2h", False), ("3µs", False), ("4μs", False), ("7ns", False), ("-1m", False),
])
def test_go_durations_are_still_accepted(tiny_server, keep_alive, unloads):
    r = httpx.post(tiny_server.url + "/api/generate", json={"model": "tiny", "keep_alive": keep_alive}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["done_reason"] == ("unload" if unloads else "load")


@pytest.mark.parametrize("keep_alive", ["", "5", "-1", "m", ".s", "5x", "1m5", "00", "5 m", "1" * 65 + "s", "s5"])
def test_what_is_no_go_duration_is_still_refused(tiny_server, keep_alive):
    r = httpx.post(tiny_server.url + "/api/generate", json={"model": "tiny", "keep_alive": keep_alive}, timeout=60)
    assert r.status_code == 400 and "keep_alive" in r.json()["error"], r.text


def test_duration_seconds_reads_every_part():
    assert duration_seconds("1h30m") == 5400.0
    assert duration_seconds("1.5s250ms") == pytest.approx(1.75)
    assert duration_seconds("-2m") == 120.0  # the sign is Ollama's "forever"; only a zero length unloads
    assert duration_seconds("5") is None


# the regex the tool-call scanner replaced: what it found is what the scanner must find
_OLD_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def old_parse(text: str) -> tuple[str | None, list]:
    calls = []
    for m in _OLD_TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(call, dict) and call.get("name") == "f":
            calls.append(call.get("arguments", {}))
    if not calls:
        return text, []
    content = _OLD_TOOL_CALL.sub("", text)
    cut = content.rfind("<tool_call>")
    if cut >= 0 and "</tool_call>" not in content[cut:]:
        content = content[:cut]  # a call the reply ended inside
    return content.strip() or None, calls


def arguments(calls: list[dict]) -> list:
    return [json.loads(c["function"]["arguments"]) for c in calls]


@pytest.mark.parametrize("text", [
    CALL, "Sure. " + CALL + " done", CALL + "\n" + CALL, "<tool_call>{ </tool_call> }</tool_call>", "<tool_call> x {}</tool_call>",
    '<tool_call>{"name": "f"} }\n</tool_call>', '<tool_call><tool_call>{"name": "f"}</tool_call>', '<tool_call>{"name": "f"',
    '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g"}</tool_call>', "plain",
])
def test_tool_calls_are_found_where_the_regex_found_them(text):
    content, calls = parse_tool_calls(text, {"f"})
    old_content, old_calls = old_parse(text)
    assert arguments(calls) == old_calls
    if calls:
        assert content == old_content


def test_a_reply_full_of_unclosed_tool_calls_parses_in_linear_time():
    # each opening tag with no close after it sent the regex over the rest of the text: 60 kB took seconds
    texts = ["<tool_call>{" * 20000 + "}x</tool_call>" * 20000, "<tool_call>{" * 40000 + "</tool_call>", "x" * 200000 + CALL]
    start = time.perf_counter()
    parsed = [parse_tool_calls(text, {"f"}) for text in texts]
    assert time.perf_counter() - start < 3
    assert parsed[0] == (texts[0], []) and parsed[1] == (texts[1], [])  # the blocks hold no JSON
    assert parsed[2][0] == "x" * 200000 and arguments(parsed[2][1]) == [{"a": 1}]
