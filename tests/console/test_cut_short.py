"""A reply that a server's shutdown ends is marked as cut short by the server, not shown as a reply that
ended by itself, and its Retry resends the turn once the server is back."""
import json
import signal

import pytest
from playwright.sync_api import expect

from ..live_server import free_port, start_cli_server, wait_healthy
from ..reliability.long_tiny import NAME, long_tiny_checkpoint, stop
from .page_tools import assert_clean, boot, settings

QUESTION = "Tell me a long story."


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory, smollm):
    return long_tiny_checkpoint(tmp_path_factory.mktemp("long_tiny"), smollm.tokenizer)


def serve(model, port: int):
    proc = start_cli_server(["--model", str(model), "--served-model-name", NAME, "--shutdown-timeout", "1"], port)
    wait_healthy(f"http://127.0.0.1:{port}", timeout=300, proc=proc)
    return proc


def test_a_reply_ended_by_a_shutdown_is_marked_and_retried(long_tiny, page):
    bodies = []
    page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions")
            and bodies.append(json.loads(r.post_data)))
    port = free_port()
    proc = serve(long_tiny, port)
    try:
        boot(page, f"http://127.0.0.1:{port}")
        settings(page)
        page.fill("#max-tokens", "3000")
        page.fill("#extra", json.dumps({"ignore_eos": True}))
        page.fill("#chat-input", QUESTION)
        page.click("#send")
        reply = page.locator(".msg.assistant").last
        expect(reply.locator(".body")).not_to_be_empty(timeout=60_000)  # it streams
        out = stop(proc, signal.SIGTERM, timeout=60)
        assert proc.returncode == 0, out[-3000:]
        stats = reply.locator(".stats")
        expect(stats).to_contain_text("cut short: the server shut down", timeout=30_000)
        assert "abort" not in stats.inner_text()
        expect(reply).to_have_class("msg assistant cut")
        assert stats.evaluate("e => getComputedStyle(e).color") == "rgb(181, 71, 8)"  # a warning, not muted
        retry = reply.get_by_role("button", name="Retry")
        expect(retry).to_be_visible()
        assert reply.locator(".body").inner_text().strip()  # what came stays on the page

        proc = serve(long_tiny, port)  # the server is back, on the same address
        expect(page.locator("#connection-text")).to_have_text("live", timeout=30_000)
        page.fill("#max-tokens", "8")
        page.fill("#extra", "")
        sent = len(bodies)
        retry.click()
        again = page.locator(".msg.assistant").last
        expect(again.locator(".stats")).to_contain_text("token", timeout=60_000)
        expect(page.locator(".msg")).to_have_count(2)  # the turn was replaced, not added to
        expect(page.locator(".msg.cut")).to_have_count(0)
        assert len(bodies) == sent + 1
        assert [m["content"] for m in bodies[-1]["messages"]] == [QUESTION]  # the same turn, without the cut reply
        assert_clean(page, "refused")
    finally:
        if proc.poll() is None:
            stop(proc)
