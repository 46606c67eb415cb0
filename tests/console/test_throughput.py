"""Live throughput at each width: tokens/s now (the last seconds) beside the minute's mean, a sparkline with
its scale, and for a key holder its own figures, never another tenant's."""
import re
import threading

import httpx
from playwright.sync_api import expect

from .page_tools import assert_clean, boot, open_page, screenshot


def stream(url: str, tokens: int, headers: dict | None = None) -> None:
    """One streamed completion, read to its end."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "stream": True, "speculative": False,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers or {}, timeout=300) as r:
        assert r.status_code == 200
        for _ in r.iter_lines():
            pass


def load(url: str, streams: int, tokens: int, headers: dict | None = None) -> list[threading.Thread]:
    threads = [threading.Thread(target=stream, args=(url, tokens, headers)) for _ in range(streams)]
    for t in threads:
        t.start()
    return threads


def test_tokens_per_second_now_beside_the_minutes_mean_with_a_scale(fast_server, view, tmp_path):
    page = view
    boot(page, fast_server.url)
    page.click("button[data-tab=live]")
    threads = load(fast_server.url, 3, 150)
    now, avg = page.locator("#tps-now"), page.locator("#tps-avg")
    expect(now).not_to_have_text("now 0.0", timeout=30_000)  # moves within seconds of the load
    expect(page.locator("#tps-top")).to_have_text(re.compile(r"^[1-9]\d*$"))  # the sparkline's scale
    expect(avg).to_contain_text("last 5 s")
    screenshot(page, f"console-throughput-{page.width_name}.png", tmp_path)
    for t in threads:
        t.join()
    # once the load ends "now" falls back to nothing while the minute still holds it
    expect(now).to_have_text("now 0.0", timeout=30_000)
    expect(avg).not_to_contain_text("last minute 0.0")
    assert_clean(page)


def test_a_key_holder_sees_its_own_tokens_per_second_only(keyed_server, browser, view):
    alice, bob = view, open_page(browser, view.width_name)
    try:
        for page, key in ((alice, "key-alice"), (bob, "key-bob")):
            page.goto(keyed_server.url + "/")
            page.fill("#key-input", key)
            page.click("#key-form button")
            expect(page.locator("#connection-text")).to_have_text("live", timeout=20_000)
            page.click("button[data-tab=live]")
            expect(page.locator("#tps-title")).to_have_text("Your output tokens/s")
        threads = load(keyed_server.url, 2, 200, {"authorization": "Bearer key-alice"})
        expect(alice.locator("#tps-now")).not_to_have_text("now 0.0", timeout=30_000)
        for t in threads:
            t.join()
        expect(alice.locator("#tps-avg")).not_to_contain_text("last minute 0.0", timeout=5_000)
        expect(bob.locator("#tps-now")).to_have_text("now 0.0")  # alice's load is not bob's to see
        expect(bob.locator("#tps-avg")).to_contain_text("last minute 0.0")
        assert_clean(alice, "401")  # the page's first look, before the key
        assert_clean(bob, "401")
    finally:
        bob.context.close()
