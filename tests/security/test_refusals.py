"""Honest refusals: what the server refuses, it refuses for the true reason, and what it can serve it serves.
A grammar that can end is never called endless; a client that trickles its request's headers is cut off
rather than holding a connection forever, while a client that pauses between requests is not."""
import json
import socket
import time

import httpx
import pytest

from ..live_server import free_port, start_cli_server, wait_healthy

MODEL = "smollm2-135m-instruct"
ALTERNATIVES = [f"a{i}" for i in range(1, 5001)]
WIDE = "start: " + " | ".join(json.dumps(a) for a in ALTERNATIVES)  # every path is two to five characters


def chat(server, **fields) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Pick one."}],
        **fields})


@pytest.mark.parametrize("field", ["guided_grammar", "grammar"])
def test_a_grammar_with_5000_short_alternatives_is_served(fast_server, field):
    r = chat(fast_server, **{field: WIDE})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in ALTERNATIVES


def test_a_grammar_that_forces_more_than_the_context_is_still_refused(fast_server):
    r = chat(fast_server, guided_grammar='start: "ab"~9000')  # no recursion: only its length is endless
    assert r.status_code == 400, r.text
    assert "forces more than the context" in r.json()["error"]["message"]


def test_a_grammar_past_the_parsers_limits_is_refused_for_that_not_as_endless(fast_server):
    r = chat(fast_server, guided_grammar="start: " + " | ".join(f'"b{i}"' for i in range(25000)))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "cannot follow it" in message and "items" in message, message
    assert "complete it" not in message and "never end" not in message, message


# ---- the request head's deadline ------------------------------------------------------------------------
HEADER_TIMEOUT = 2.0
CUT_OFF_WITHIN = 8.0  # well past the timeout: a busy machine's server still closes it by then


@pytest.fixture(scope="module")
def slow_headed(tiny_checkpoints):
    """`kvserve serve --header-timeout 2` on the tiny model: the flag as an operator passes it."""
    port = free_port()
    proc = start_cli_server(["--model", str(tiny_checkpoints["llama"]), "--header-timeout", str(HEADER_TIMEOUT),
                             "--log-level", "warning"], port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=300, proc=proc)
        yield port, url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except Exception:
            proc.kill()


def trickle(sock: socket.socket, first: bytes, limit: float) -> tuple[float | None, bytes]:
    """Send `first`, then one header byte every half second until the server closes the connection.
    -> (seconds until it closed, None if it did not within `limit`; what it answered)."""
    sock.sendall(first)
    start, answer = time.monotonic(), b""
    header = iter(b"x-slow: " + b"a" * 1000)
    sock.settimeout(0.5)
    while time.monotonic() - start < limit:
        try:
            sock.send(bytes([next(header)]))
            chunk = sock.recv(4096)  # waits out the half second between bytes
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return time.monotonic() - start, answer
        if not chunk:
            return time.monotonic() - start, answer
        answer += chunk
    return None, answer


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a content-length: (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:"))
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, "closed mid-body"
        body += chunk
    return int(lines[0].split()[1]), body


def test_headers_sent_a_byte_at_a_time_are_cut_off(slow_headed):
    port, _ = slow_headed
    with socket.create_connection(("127.0.0.1", port)) as sock:
        took, answer = trickle(sock, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", CUT_OFF_WITHIN)
    assert took is not None, f"still open after {CUT_OFF_WITHIN}s of trickled headers"
    assert took >= HEADER_TIMEOUT - 0.5
    assert answer.startswith(b"HTTP/1.1 408"), answer  # it says why


def test_a_connection_that_never_sends_a_byte_is_closed(slow_headed):
    port, _ = slow_headed
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(CUT_OFF_WITHIN)
        start = time.monotonic()
        assert sock.recv(4096) == b""
    assert HEADER_TIMEOUT - 0.5 <= time.monotonic() - start < CUT_OFF_WITHIN


def test_a_kept_alive_connection_that_pauses_between_requests_is_served(slow_headed):
    port, _ = slow_headed
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(30)
        sock.sendall(request[:20])  # a head in two parts a second apart: slow, but within the timeout
        time.sleep(1)
        sock.sendall(request[20:])
        assert read_response(sock)[0] == 200
        time.sleep(1)
        sock.sendall(request[:20])  # the next one, after a pause, the same: its clock starts at its first byte
        time.sleep(1)
        sock.sendall(request[20:])
        assert read_response(sock)[0] == 200


def test_a_body_sent_slowly_is_not_cut_by_the_header_timeout(slow_headed):
    port, _ = slow_headed
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.settimeout(60)
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), len(body) // 3 + 1):  # over three seconds, past the header timeout
            sock.sendall(body[i:i + len(body) // 3 + 1])
            time.sleep(1)
        status, answer = read_response(sock)
    assert status == 200, answer
    assert json.loads(answer)["generated_text"] is not None


def test_health_stays_fast_while_20_slow_heads_are_open_and_they_are_all_closed(slow_headed):
    port, url = slow_headed
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nx-slow: a")
        for _ in range(3):
            start = time.monotonic()
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            assert time.monotonic() - start < 1.5
        deadline = time.monotonic() + CUT_OFF_WITHIN
        for sock in socks:
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            answer = b""
            while chunk := sock.recv(4096):  # a socket.timeout here: one still open past the bound
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
    finally:
        for sock in socks:
            sock.close()
