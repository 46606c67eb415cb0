"""The web console in a real headless Chromium (Debian's, driven by Playwright) against real servers."""
import httpx
from playwright.sync_api import expect

from .page_tools import ROOT, assert_clean, chat, screenshot


def test_page_loads_clean_and_streams_a_chat_reply(fast_server, page, tmp_path):
    page.goto(fast_server.url + "/")
    expect(page.locator("#model")).to_have_text("smollm2-135m-instruct")
    page.fill("#system", "You are a concise assistant.")
    page.fill("#seed", "1")
    page.fill("#max-tokens", "48")
    page.fill("#chat-input", "Name three colours of the rainbow.")
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".body")).not_to_be_empty(timeout=30_000)  # text arrives before the reply ends
    expect(reply.locator(".stats")).to_contain_text("tokens/s", timeout=60_000)
    expect(reply.locator(".stats")).to_contain_text("TTFT")
    expect(reply.locator(".stats")).to_contain_text("prompt tokens cached")
    assert page.locator("#send").is_enabled()
    screenshot(page, "console-chat.png", tmp_path)
    assert_clean(page)
    assert httpx.get(fast_server.url + "/ui").text == httpx.get(fast_server.url + "/").text


def test_a_session_made_by_the_api_appears_live_and_the_page_deletes_it(fast_server, page, tmp_path):
    url = fast_server.url
    sid = httpx.post(url + "/v1/sessions", json={"capacity": 512, "sizing": "dynamic"}).json()["id"]
    httpx.post(url + "/generate", json={"inputs": "The history of the bicycle began", "session_id": sid,
                                        "parameters": {"max_new_tokens": 40}}, timeout=60)
    static = httpx.post(url + "/v1/sessions", json={"capacity": 256, "sizing": "static"}).json()["id"]
    page.goto(url + "/")
    page.click("button[data-tab=live]")
    late = httpx.post(url + "/v1/sessions", json={"capacity": 300}).json()["id"]
    row = page.locator(f'tr[data-id="{late}"]')
    expect(row.locator(".bar")).to_be_visible(timeout=2_000)  # within 2 s of its creation
    expect(row).to_contain_text("0 / 300")
    expect(page.locator(f'tr[data-id="{sid}"]')).to_contain_text("/ 512")
    expect(page.locator(f'tr[data-id="{static}"]')).to_contain_text("static")
    expect(page.locator("#pool-text")).to_contain_text("hit rate")
    expect(page.locator("#pool-text")).to_contain_text("disk tier: off")  # no --kv-disk here
    expect(page.locator("#tps-text")).to_contain_text("speculation ngram")
    screenshot(page, "console-live.png", tmp_path)
    row.locator("button[data-act=delete]").click()
    expect(row).to_have_count(0, timeout=3_000)
    assert httpx.get(f"{url}/v1/sessions/{late}").status_code == 404
    for other in (sid, static):
        httpx.delete(f"{url}/v1/sessions/{other}")
    assert_clean(page)


def test_markup_in_a_reply_is_shown_as_text(fast_server, page):
    page.goto(fast_server.url + "/")
    # the real model, held by a grammar to a reply that is pure markup
    evil = r'<script>window\.pwned=1</script><img src=x onerror=window\.pwned=2>'
    page.fill("#extra", '{"guided_regex": "%s", "max_tokens": 64}' % evil.replace("\\", "\\\\"))
    reply = chat(page, "Say something.")
    assert reply.locator(".body").inner_text().strip() == "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"
    assert page.locator("#messages img, #messages script").count() == 0
    assert page.evaluate("window.pwned") is None
    assert_clean(page)


def test_with_api_keys_the_page_asks_for_one_and_shows_its_owners_sessions_only(keyed_server, page):
    url = keyed_server.url
    mine = httpx.post(url + "/v1/sessions", json={}, headers={"authorization": "Bearer key-alice"}).json()["id"]
    theirs = httpx.post(url + "/v1/sessions", json={}, headers={"authorization": "Bearer key-bob"}).json()["id"]
    page.goto(url + "/")
    expect(page.locator("#key-form")).to_be_visible()
    expect(page.locator("#app")).to_be_hidden()
    page.fill("#key-input", "key-alice")
    page.click("#key-form button")
    page.click("button[data-tab=live]")
    expect(page.locator(f'tr[data-id="{mine}"]')).to_be_visible(timeout=2_000)
    expect(page.locator(f'tr[data-id="{theirs}"]')).to_have_count(0)
    assert page.evaluate("sessionStorage.getItem('kvserve-key')") == "key-alice"
    # the live view shows this key's own figures, never the server's load
    expect(page.locator("#requests-text")).to_contain_text("1 of 4096 sessions")
    expect(page.locator("#tps-title")).to_have_text("Your output tokens/s")
    page.reload()  # kept for the browser session: no second prompt
    expect(page.locator("#app")).to_be_visible()


def overflow(page) -> int:
    """How far the page reaches past the viewport sideways, in CSS pixels."""
    return page.evaluate("document.documentElement.scrollWidth - window.innerWidth")


def test_at_phone_width_nothing_overflows_sideways(browser, fast_server):
    context = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    page = context.new_page()
    try:
        page.goto(fast_server.url + "/")
        page.fill("#chat-input", "Hi")
        page.click("#send")
        expect(page.locator(".msg.assistant .stats")).to_contain_text("tokens", timeout=60_000)
        assert overflow(page) <= 0
        assert page.locator("#messages").bounding_box()["width"] > 300  # the chat takes the width, not 90 px
        page.click("button[data-tab=live]")
        expect(page.locator("#sessions")).to_be_visible()
        assert overflow(page) <= 0
    finally:
        context.close()


def test_the_page_stays_small():
    assert sum(f.stat().st_size for f in (ROOT / "server" / "api" / "console_page").iterdir()) < 200_000
