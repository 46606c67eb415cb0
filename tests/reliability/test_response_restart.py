"""A stored response whose server was killed while it ran reads as incomplete after the restart, never as
in_progress forever, and a conversation continues from it with what was kept: its input, not the lost reply."""
import json

import httpx
import pytest

from .long_tiny import NAME, long_tiny_checkpoint, serve, settle_disk, stop


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smollm):
    return long_tiny_checkpoint(tmp_path_factory.mktemp("long_tiny"), smollm.tokenizer)


def start_streaming(url: str, client: httpx.Client):
    """A long streamed stored response, read up to its first text: (its id, the open stream, its lines: kept
    referenced, since a line iterator collected closes the connection)."""
    body = {"model": NAME, "input": "Tell me a long story.", "max_output_tokens": 2000, "stream": True}
    stream = client.stream("POST", url + "/v1/responses", json=body, timeout=120)
    r = stream.__enter__()
    assert r.status_code == 200
    response_id = None
    lines = r.iter_lines()
    for line in lines:
        if line.startswith("data: "):
            data = json.loads(line[6:])
            response_id = response_id or data.get("response", {}).get("id")
            if data["type"] == "response.output_text.delta":
                return response_id, stream, lines
    raise AssertionError("the stream ended before its first text")


def test_a_response_cut_by_kill_9_reads_incomplete_and_continues_from_what_was_kept(tmp_path, long_tiny):
    store = tmp_path / "store"
    proc, url = serve(long_tiny, store)
    try:
        done = httpx.post(url + "/v1/responses", json={"model": NAME, "input": "Hi", "max_output_tokens": 4},
                          timeout=120).json()
        assert done["status"] != "in_progress"
        with httpx.Client() as client:
            cut, stream, _lines = start_streaming(url, client)
            settle_disk(url)  # the in_progress record is on disk, as it would be a moment after any start
            assert httpx.get(f"{url}/v1/responses/{cut}").json()["status"] == "in_progress"
            stop(proc)
            stream.__exit__(None, None, None)
    finally:
        if proc.poll() is None:
            stop(proc)
    proc, url = serve(long_tiny, store)
    try:
        for _ in range(2):  # rewritten once, and read so from then on
            got = httpx.get(f"{url}/v1/responses/{cut}").json()
            assert got["status"] == "incomplete", got
            assert got["incomplete_details"] == {"reason": "server_restarted"}
            assert got["output"] == []
        assert httpx.get(f"{url}/v1/responses/{done['id']}").json() == done  # a finished one stands as it was

        # continuing from it continues from the conversation it kept: its input, and no reply
        more = httpx.post(url + "/v1/responses", json={"model": NAME, "previous_response_id": cut, "input": "Go on.",
                                                       "max_output_tokens": 4}, timeout=120)
        assert more.status_code == 200, more.text
        fresh = httpx.post(url + "/v1/responses", json={
            "model": NAME, "store": False, "max_output_tokens": 4,
            "input": [{"role": "user", "content": "Tell me a long story."}, {"role": "user", "content": "Go on."}],
        }, timeout=120).json()
        assert more.json()["usage"]["input_tokens"] == fresh["usage"]["input_tokens"]
    finally:
        out = stop(proc)
    assert "Traceback" not in out, out[-3000:]
