"""Sessions in the console at each width: continuing one shows its turns and appends to them, never
overwriting; a session that no longer exists is said plainly, with a button to start a new one."""
import json

import httpx
from playwright.sync_api import expect

from .page_tools import assert_clean, boot, chat, screenshot, settings

GREETING = "Nice to meet you, Ada."


def session_with_a_turn(url: str) -> str:
    """A session of one chat turn made through the API, then forked: the page is given the fork."""
    sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=120, json={
        "messages": [{"role": "user", "content": "My name is Ada."}], "max_tokens": 16,
        "guided_regex": GREETING.replace(".", "\\.")})
    assert r.json()["choices"][0]["message"]["content"] == GREETING
    fork = httpx.post(f"{url}/v1/sessions/{sid}/fork").json()["id"]
    httpx.delete(f"{url}/v1/sessions/{sid}")
    return fork


def pick(page, sid: str) -> None:
    settings(page)
    page.select_option("#session-mode", "existing")
    expect(page.locator(f'#existing-session option[value="{sid}"]')).to_have_count(1, timeout=5_000)
    page.select_option("#existing-session", sid)


def session_ids(page) -> list[str]:
    """The X-Session-Id of every chat request the page sends."""
    ids = []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and ids.append(r.headers.get("x-session-id")))
    return ids


def test_continuing_a_session_shows_its_turns_and_appends_to_them(fast_server, view, tmp_path):
    page, url = view, fast_server.url
    sid = session_with_a_turn(url)
    before = httpx.get(f"{url}/v1/sessions/{sid}").json()
    boot(page, url)
    pick(page, sid)
    expect(page.locator(".msg.user")).to_have_text("My name is Ada.")
    expect(page.locator(".msg.assistant")).to_have_text(GREETING)
    expect(page.locator("#system")).to_have_value(before["messages"][0]["content"])  # the template's own default
    page.fill("#max-tokens", "8")
    chat(page, "What is my name?")
    after = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert after["text"].startswith(before["text"]) and after["length"] > before["length"]  # appended, not overwritten
    assert after["messages"][:3] == before["messages"] and after["messages"][3]["content"] == "What is my name?"
    screenshot(page, f"console-continued-{page.width_name}.png", tmp_path)
    httpx.delete(f"{url}/v1/sessions/{sid}")
    assert_clean(page)


def test_a_session_of_text_is_shown_and_continued_by_completion(fast_server, view):
    page, url = view, fast_server.url
    sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    httpx.post(url + "/generate", timeout=120, json={"inputs": "The history of the bicycle began", "session_id": sid,
                                                     "parameters": {"max_new_tokens": 6}})
    before = httpx.get(f"{url}/v1/sessions/{sid}").json()["text"]
    boot(page, url)
    pick(page, sid)
    expect(page.locator("#session-note")).to_contain_text("holds text, not chat turns")
    expect(page.locator("#session-note .history")).to_have_text(before)
    page.fill("#max-tokens", "6")
    page.fill("#chat-input", "Hi")
    page.press("#chat-input", "Enter")
    expect(page.locator("#chat-hint")).to_contain_text("continue it in Completion")  # a chat would overwrite it
    assert page.locator(".msg").count() == 0
    page.click("button[data-tab=complete]")
    expect(page.locator("#complete-history")).to_have_text(before)
    page.fill("#prompt", " in France")
    page.click("#complete-go")
    expect(page.locator("#completion-stats")).to_contain_text("token", timeout=60_000)
    assert httpx.get(f"{url}/v1/sessions/{sid}").json()["text"].startswith(before + " in France")
    httpx.delete(f"{url}/v1/sessions/{sid}")
    assert_clean(page)


def send_to_a_gone_session_and_start_anew(page, text):
    """Send `text` to a session that no longer exists: the turn says so plainly, and its button starts a
    new session that answers."""
    page.fill("#chat-input", text)
    page.click("#send")
    failed = page.locator(".msg.assistant.failed")
    expect(failed.locator(".stats")).to_contain_text("This session no longer exists", timeout=30_000)
    failed.get_by_role("button", name="Start a new session").click()
    expect(page.locator(".msg.assistant").last.locator(".stats")).to_contain_text("token", timeout=60_000)


def test_a_deleted_session_is_said_plainly_with_a_button_to_start_a_new_one(fast_server, view):
    page, url = view, fast_server.url
    used, bodies = session_ids(page), []
    page.on("request", lambda r: r.url.endswith("/v1/chat/completions") and bodies.append(json.loads(r.post_data)))
    boot(page, url)
    settings(page)
    page.select_option("#session-mode", "new")
    page.fill("#max-tokens", "8")
    chat(page, "Hi")
    assert httpx.delete(f"{url}/v1/sessions/{used[-1]}").status_code == 200
    send_to_a_gone_session_and_start_anew(page, "Again")
    expect(page.locator(".msg.failed")).to_have_count(0)
    assert used[-1] != used[0] and httpx.get(f"{url}/v1/sessions/{used[-1]}").status_code == 200
    assert [m["content"] for m in bodies[-1]["messages"] if m["role"] == "user"] == ["Hi", "Again"]  # carried over
    # Regenerate on a session deleted meanwhile: the same plain words, no uncaught error
    httpx.delete(f"{url}/v1/sessions/{used[-1]}")
    page.click("#regenerate")
    expect(page.locator(".msg.assistant.failed .stats")).to_contain_text("This session no longer exists", timeout=30_000)
    expect(page.locator(".msg.assistant.failed").get_by_role("button", name="Start a new session")).to_be_visible()
    assert_clean(page, "404")


def test_a_picked_session_deleted_meanwhile_is_said_plainly(fast_server, page):
    url = fast_server.url
    sid = session_with_a_turn(url)
    boot(page, url)
    pick(page, sid)
    expect(page.locator(".msg.assistant")).to_have_text(GREETING)
    httpx.delete(f"{url}/v1/sessions/{sid}")
    page.fill("#max-tokens", "8")
    send_to_a_gone_session_and_start_anew(page, "Still there?")
    expect(page.locator("#session-mode")).to_have_value("new")  # the picked one is not written over
    assert_clean(page, "404")


def test_the_live_view_creates_a_session(fast_server, view):
    page, url = view, fast_server.url
    boot(page, url)
    page.click("button[data-tab=live]")
    before = {s["id"] for s in httpx.get(url + "/v1/sessions").json()["data"]}
    page.get_by_role("button", name="New session").click()
    made = page.locator("#live-note")
    expect(made).to_contain_text("Made session", timeout=10_000)
    new = {s["id"] for s in httpx.get(url + "/v1/sessions").json()["data"]} - before
    assert len(new) == 1, new
    sid = new.pop()
    expect(made).to_contain_text(sid)
    row = page.locator(f'tr[data-id="{sid}"]')
    expect(row).to_be_visible(timeout=5_000)  # in the table at the next status
    expect(row.locator("td.state")).to_have_text("idle")
    # and the chat can continue it at once
    page.click("button[data-tab=chat]")
    settings(page)
    page.select_option("#session-mode", "existing")
    expect(page.locator(f'#existing-session option[value="{sid}"]')).to_have_count(1, timeout=5_000)
    httpx.delete(f"{url}/v1/sessions/{sid}")
    assert_clean(page)
