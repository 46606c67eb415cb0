"""The console's layout at each width, phone first: the message box on the first screen, the settings
folded on a phone, the live table as cards below 720 px, code that scrolls sideways; and the small
things: an empty key, locked tabs, counts with their nouns, a page without JavaScript."""
import json

import httpx
from playwright.sync_api import expect

from ..server.chat_templates import exactly
from .page_tools import assert_clean, boot, chat, open_page, screenshot, settings

CODE_LINE = "total = " + " + ".join(f"value_{i}" for i in range(30))
CODE_REPLY = f"Here it is:\n```python\n{CODE_LINE}\n```\nDone."


def within_width(page, locator) -> bool:
    box = locator.bounding_box()
    return box is not None and box["x"] >= 0 and box["x"] + box["width"] <= page.viewport_size["width"]


def overflow(page) -> int:
    """How far the page reaches past the viewport sideways, in CSS pixels."""
    return page.evaluate("document.documentElement.scrollWidth - window.innerWidth")


def test_the_message_box_is_on_the_first_screen_and_the_settings_fold_on_a_phone(fast_server, view, tmp_path):
    page = view
    boot(page, fast_server.url)
    box = page.locator("#chat-input").bounding_box()
    assert 0 <= box["y"] and box["y"] + box["height"] <= page.viewport_size["height"]  # no scrolling to find it
    phone = page.width_name == "phone"
    if phone:  # folded away under the chat
        expect(page.locator("#temperature")).to_be_hidden()
    else:
        expect(page.locator("#temperature")).to_be_visible()
    settings(page)
    expect(page.locator("#temperature")).to_be_visible()
    page.click("#settings summary")  # and folds away again
    expect(page.locator("#temperature")).to_be_hidden()
    page.click("#settings summary")
    page.fill("#max-tokens", "48")
    page.fill("#seed", "1")
    page.click("#settings summary")
    chat(page, "Name three colours of the rainbow.")
    assert overflow(page) <= 0
    screenshot(page, "console-phone.png" if phone else f"console-chat-{page.width_name}.png", tmp_path)
    assert_clean(page)


def test_the_live_table_becomes_cards_on_a_phone(fast_server, view, tmp_path):
    page, url = view, fast_server.url
    sid = httpx.post(url + "/v1/sessions", json={"capacity": 300}).json()["id"]
    boot(page, url)
    page.click("button[data-tab=live]")
    row = page.locator(f'tr[data-id="{sid}"]')
    expect(row).to_be_visible(timeout=5_000)
    state, delete = row.locator("td.state"), row.locator("button[data-act=delete]")
    expect(state).to_have_text("idle")
    # its state and its actions are on screen at every width, with nothing to scroll sideways
    assert within_width(page, state) and within_width(page, delete)
    assert overflow(page) <= 0
    if page.width_name == "phone":  # cards, each value labelled
        expect(page.locator("#sessions thead")).to_be_hidden()
        assert state.evaluate("e => getComputedStyle(e, '::before').content") == '"state"'
    else:
        expect(page.locator("#sessions thead")).to_be_visible()
    screenshot(page, f"console-live-{page.width_name}.png", tmp_path)
    delete.click()
    expect(row).to_have_count(0, timeout=5_000)
    assert_clean(page)


def test_code_blocks_scroll_sideways_and_end_cleanly(fast_server, view):
    page = view
    boot(page, fast_server.url)
    settings(page)
    page.fill("#max-tokens", "200")
    page.fill("#extra", json.dumps({"guided_regex": exactly(CODE_REPLY)}))
    reply = chat(page, "Show me a long line of code.")
    pre, code = reply.locator("pre"), reply.locator("pre code")
    expect(code).to_have_text(CODE_LINE)  # one line, no empty one after it
    assert pre.evaluate("e => getComputedStyle(e).whiteSpace") == "pre"
    assert pre.evaluate("e => e.scrollWidth > e.clientWidth")  # the line scrolls inside its block...
    assert overflow(page) <= 0  # ...not the page
    after = reply.locator("pre + p")
    expect(after).to_have_text("Done.")
    assert not after.evaluate("e => e.innerHTML").startswith("<br>")
    assert_clean(page)


def test_an_empty_key_is_refused_and_locked_tabs_cannot_be_clicked(keyed_server, view):
    page, url = view, keyed_server.url
    page.goto(url + "/")
    expect(page.locator("#key-form")).to_be_visible()
    for tab in page.locator(".tab").all():
        expect(tab).to_be_disabled()
    page.click("#key-form button")
    expect(page.locator("#key-error")).to_contain_text("Enter the API key")
    page.fill("#key-input", "not-a-key")
    page.click("#key-form button")
    expect(page.locator("#key-error")).to_contain_text("the key was not accepted")
    page.fill("#key-input", "key-alice")
    page.click("#key-form button")
    expect(page.locator("#connection-text")).to_have_text("live", timeout=20_000)
    for tab in page.locator(".tab").all():
        expect(tab).to_be_enabled()
    mine = [httpx.post(url + "/v1/sessions", json={}, headers={"authorization": "Bearer key-alice"}).json()["id"]]
    page.click("button[data-tab=live]")
    expect(page.locator("#sessions-count")).to_have_text("1 session")  # not "1 sessions"
    mine.append(httpx.post(url + "/v1/sessions", json={}, headers={"authorization": "Bearer key-alice"}).json()["id"])
    expect(page.locator("#sessions-count")).to_have_text("2 sessions")
    for sid in mine:
        httpx.delete(f"{url}/v1/sessions/{sid}", headers={"authorization": "Bearer key-alice"})
    assert_clean(page, "401")


def test_without_javascript_the_page_says_it_needs_it(fast_server, browser):
    page = open_page(browser, java_script_enabled=False)
    try:
        page.goto(fast_server.url + "/")
        expect(page.locator("noscript .notice")).to_be_visible()
        expect(page.locator("noscript .notice")).to_contain_text("needs JavaScript")
    finally:
        page.context.close()
