"""The chat's input, as typed: a line break written with Shift+Enter is sent and shown; Stop clears the
word that a reply is still coming; on a phone Tab reaches the message box before the settings, and a
refused setting's message is drawn on the screen."""
import json

from playwright.sync_api import expect

from .page_tools import assert_clean, boot, chat, open_page, settings

# a reply held by a grammar to many short lines, decoded one token a step, so it streams for a while
LINES = {"guided_regex": "(The quick brown fox jumps over the lazy dog\\.\\n){60}", "speculative": False}


def on_screen(page, locator) -> bool:
    box = locator.bounding_box()
    size = page.viewport_size
    return (box is not None and box["height"] > 0 and 0 <= box["y"] and box["y"] + box["height"] <= size["height"]
            and 0 <= box["x"] and box["x"] + box["width"] <= size["width"])


def test_a_message_keeps_the_line_breaks_written_with_shift_enter(fast_server, page):
    bodies = []
    page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions")
            and bodies.append(json.loads(r.post_data)))
    boot(page, fast_server.url)
    page.fill("#max-tokens", "8")
    box = page.locator("#chat-input")
    box.click()
    box.type("First line")
    box.press("Shift+Enter")
    box.type("second line")
    box.press("Shift+Enter")
    box.press("Shift+Enter")
    box.type("a new paragraph")
    expect(box).to_have_value("First line\nsecond line\n\na new paragraph")  # not sent yet
    box.press("Enter")
    expect(page.locator(".msg.assistant").last.locator(".stats")).to_contain_text("token", timeout=60_000)
    assert [m["content"] for m in bodies[-1]["messages"] if m["role"] == "user"] == ["First line\nsecond line\n\na new paragraph"]
    shown = page.locator(".msg.user .body")
    assert shown.inner_text().split("\n") == ["First line", "second line", "", "a new paragraph"]
    assert_clean(page)


def test_stop_clears_the_word_that_a_reply_is_still_coming(fast_server, page):
    boot(page, fast_server.url)
    page.fill("#max-tokens", "800")
    page.fill("#extra", json.dumps(LINES))
    page.fill("#chat-input", "Write the pangram sixty times.")
    page.click("#send")
    expect(page.locator(".msg.assistant .body")).to_contain_text("quick brown fox", timeout=60_000)
    page.fill("#chat-input", "And then?")
    page.press("#chat-input", "Enter")
    expect(page.locator("#chat-hint")).to_contain_text("still coming")
    page.click("#stop")
    expect(page.locator(".msg.assistant").last.locator(".stats")).to_contain_text("stopped", timeout=30_000)
    expect(page.locator("#chat-hint")).to_have_text("")  # nothing is coming any more
    expect(page.locator("#chat-input")).to_have_value("And then?")  # kept, to send now
    page.fill("#extra", "")
    page.fill("#max-tokens", "8")
    chat(page, "And then?")
    expect(page.locator("#chat-hint")).to_have_text("")
    assert_clean(page)


def test_on_a_phone_tab_reaches_the_message_box_before_the_settings(fast_server, browser):
    page = open_page(browser, "phone")
    try:
        boot(page, fast_server.url)
        order = []
        for _ in range(30):
            page.keyboard.press("Tab")
            order.append(page.evaluate("() => document.activeElement.id || document.activeElement.tagName.toLowerCase()"))
            if "chat-input" in order and "summary" in order:
                break
        assert "chat-input" in order and "summary" in order, order
        assert order.index("chat-input") < order.index("summary"), order
        # the desktop keeps the settings first, beside the chat, as they are drawn
        page.set_viewport_size({"width": 1280, "height": 800})
        page.locator("#model").click()
        for _ in range(30):
            page.keyboard.press("Tab")
            now = page.evaluate("() => document.activeElement.id || document.activeElement.tagName.toLowerCase()")
            if now in ("chat-input", "summary"):
                break
        assert now == "summary"
        assert_clean(page)
    finally:
        page.context.close()


def test_on_a_phone_a_refused_setting_is_said_on_the_screen(fast_server, browser):
    page = open_page(browser, "phone")
    try:
        boot(page, fast_server.url)
        settings(page)
        page.fill("#extra", "{not json")
        page.click("#settings summary")  # folded away again, as a phone keeps them
        page.fill("#chat-input", "Hi")
        page.click("#send")
        note = page.locator(".field-error")
        expect(note).to_contain_text("Extra request fields are not valid JSON")
        page.wait_for_timeout(500)  # a smooth scroll, if any, has ended
        assert on_screen(page, note), (note.bounding_box(), page.viewport_size)
        assert on_screen(page, page.locator("#extra"))
        expect(page.locator("#extra")).to_be_focused()
        assert page.locator(".msg").count() == 0
        assert_clean(page)
    finally:
        page.context.close()
