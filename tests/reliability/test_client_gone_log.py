"""A client that times out before a non-streamed answer is one line in the server's log, not a traceback."""
import signal

import httpx
import pytest

from .long_tiny import NAME, long_tiny_checkpoint, serve, stop


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smollm):
    return long_tiny_checkpoint(tmp_path_factory.mktemp("long_tiny"), smollm.tokenizer)


def test_a_client_that_times_out_is_one_log_line(tmp_path, long_tiny):
    proc, url = serve(long_tiny, tmp_path / "store")
    try:
        body = {"model": NAME, "max_tokens": 3000, "ignore_eos": True, "messages": [{"role": "user", "content": "Go on."}]}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/chat/completions", json=body, timeout=1.5)
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={**body, "max_tokens": 2})
        assert r.status_code == 200, r.text  # the server serves on
    finally:
        out = stop(proc, signal.SIGTERM)
    assert "POST /v1/chat/completions: the client disconnected before its answer" in out, out[-3000:]
    assert "Traceback" not in out and "CancelledError" not in out, out[-3000:]
