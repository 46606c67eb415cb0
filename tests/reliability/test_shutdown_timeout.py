"""`kvserve serve --shutdown-timeout 2` with a stream that outlasts it: the process is gone within the
timeout plus a second of SIGTERM, and the stream still ends with its final event."""
import json
import signal
import threading
import time

import httpx
import pytest

from .long_tiny import NAME, long_tiny_checkpoint, serve, stop

TIMEOUT_S = 2


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smollm):
    return long_tiny_checkpoint(tmp_path_factory.mktemp("long_tiny"), smollm.tokenizer)


def test_sigterm_exits_within_the_shutdown_timeout_plus_a_second(tmp_path, long_tiny):
    proc, url = serve(long_tiny, tmp_path / "store", "--shutdown-timeout", str(TIMEOUT_S))
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = {"model": NAME, "messages": [{"role": "user", "content": "Tell me a long story."}], "stream": True,
                "max_tokens": 3000, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    if len(lines) >= 3:
                        started.set()

    reader = threading.Thread(target=read)
    try:
        reader.start()
        assert started.wait(60)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
        out = proc.stdout.read()
        reader.join(30)
    finally:
        if proc.poll() is None:
            stop(proc)
    assert proc.returncode == 0, out[-3000:]
    assert took <= TIMEOUT_S + 1, (took, out[-3000:])
    assert not reader.is_alive()
    assert lines[-1] == "data: [DONE]", lines[-3:]  # the stream ended with its final event, not a cut
    chunks = [json.loads(line[6:]) for line in lines[:-1] if line.startswith("data: ")]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "abort"
