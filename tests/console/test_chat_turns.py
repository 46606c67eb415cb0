"""The chat's turns at each width: a failed turn is marked, never resent, and can be retried or removed; a
history that no longer fits offers to drop its oldest turns or start over; the list follows a streaming
reply unless the reader scrolls up; a send while a reply streams says so."""
import json

import pytest
from playwright.sync_api import expect

from server.config import EngineConfig

from ..live_server import LiveServer
from .page_tools import assert_clean, boot, chat, screenshot, settings

CAPACITY = 256
WORDS = "word " * 200  # about 200 tokens: fits a session of 256 alone, not after two turns


@pytest.fixture(scope="module")
def small_server(served_model):
    """Sessions of 256 tokens: a conversation outgrows one in a few turns."""
    with LiveServer(served_model, EngineConfig(session_capacity=CAPACITY)) as server:
        yield server


def chat_bodies(page) -> list[dict]:
    """The body of every chat request the page sends, as it sends them."""
    bodies = []
    page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions")
            and bodies.append(json.loads(r.post_data)))
    return bodies


def users(body: dict) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "user"]


def start(page, url: str, max_tokens: str = "8") -> None:
    boot(page, url)
    settings(page)
    page.select_option("#session-mode", "new")
    page.fill("#max-tokens", max_tokens)


def test_a_failed_turn_is_marked_never_resent_and_can_be_retried_or_removed(small_server, view, tmp_path):
    page, sent = view, chat_bodies(view)
    start(page, small_server.url)
    chat(page, "Hi")
    too_long = "word " * 400
    page.fill("#chat-input", too_long)
    page.click("#send")
    failed = page.locator(".msg.assistant.failed")
    expect(failed.locator(".stats")).to_contain_text(f"exceeds the session capacity of {CAPACITY}", timeout=30_000)
    expect(failed.locator(".stats")).to_contain_text("This message alone is too long")  # dropping turns would not help
    expect(page.locator(".msg.user.failed")).to_contain_text("word word")
    assert failed.locator(".stats").evaluate("e => getComputedStyle(e).color") == "rgb(180, 35, 24)"  # an error, in red
    expect(failed.get_by_role("button", name="Drop the oldest turn")).to_have_count(0)
    screenshot(page, f"console-failed-turn-{page.width_name}.png", tmp_path)

    chat(page, "Hello again")  # the failed turn is not resent: the short one goes through
    assert users(sent[-1]) == ["Hi", "Hello again"]
    failed.get_by_role("button", name="Retry").click()  # it goes to the end and fails again, alone
    expect(page.locator(".msg.user").last).to_contain_text("word word")
    expect(page.locator(".msg.assistant.failed .stats")).to_contain_text("exceeds", timeout=30_000)
    assert users(sent[-1]) == ["Hi", "Hello again", too_long.strip()]
    page.locator(".msg.assistant.failed").get_by_role("button", name="Remove").click()
    expect(page.locator(".msg.failed")).to_have_count(0)
    expect(page.locator(".msg")).to_have_count(4)
    expect(page.locator("#regenerate")).to_be_enabled()
    assert_clean(page, "400")


def test_a_history_that_no_longer_fits_drops_its_oldest_turns_or_starts_over(small_server, view):
    page, sent = view, chat_bodies(view)
    start(page, small_server.url)
    chat(page, "Hi")
    chat(page, "Hello again")
    page.fill("#chat-input", WORDS)
    page.click("#send")
    failed = page.locator(".msg.assistant.failed")
    expect(failed.locator(".stats")).to_contain_text("no longer fits", timeout=30_000)
    failed.get_by_role("button", name="Drop").click()
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".stats")).to_contain_text("token", timeout=60_000)
    expect(page.locator(".msg.failed")).to_have_count(0)
    dropped = page.locator(".msg.dropped")
    expect(dropped.first).to_contain_text("Hi")
    assert users(sent[-1])[-1] == WORDS.strip() and "Hi" not in users(sent[-1])
    # the next turn still leaves the dropped ones out
    page.click("#clear")
    chat(page, "Hi")
    chat(page, "Hello again")
    page.fill("#chat-input", WORDS)
    page.click("#send")
    expect(failed.locator(".stats")).to_contain_text("no longer fits", timeout=30_000)
    failed.get_by_role("button", name="Start over").click()
    expect(page.locator(".msg")).to_have_count(2)
    expect(page.locator(".msg.assistant .stats")).to_contain_text("token", timeout=60_000)
    assert users(sent[-1]) == [WORDS.strip()]
    assert_clean(page, "400")


# a reply held by a grammar to many short lines, decoded one token a step, so it streams for a while
LINES = {"guided_regex": "(The quick brown fox jumps over the lazy dog\\.\\n){60}", "speculative": False}


def at_bottom(page) -> bool:
    return page.locator("#messages").evaluate("e => e.scrollHeight - e.scrollTop - e.clientHeight < 40")


def reply_length(page) -> int:
    return len(page.locator(".msg.assistant").last.locator(".body").inner_text())


def test_the_list_follows_a_streaming_reply_until_the_reader_scrolls_up(fast_server, view):
    page = view
    boot(page, fast_server.url)
    settings(page)
    page.fill("#max-tokens", "800")
    page.fill("#extra", json.dumps(LINES))
    page.fill("#chat-input", "Write the pangram sixty times.")
    page.click("#send")
    messages = page.locator("#messages")
    page.wait_for_function("() => { const m = document.querySelector('#messages'); return m.scrollHeight > m.clientHeight + 100; }",
                           timeout=60_000)
    assert at_bottom(page)  # it followed the reply past the fold
    messages.evaluate("e => { e.scrollTop = 0; }")
    grown = reply_length(page) + 200
    page.wait_for_function(f"() => document.querySelector('.msg.assistant:last-child .body').innerText.length > {grown}",
                           timeout=60_000)
    assert messages.evaluate("e => e.scrollTop") < 40  # more text came, and the reader stayed where they were
    # a send while it streams is not lost in silence: the page says why, and keeps the text
    page.fill("#chat-input", "And then?")
    page.press("#chat-input", "Enter")
    expect(page.locator("#chat-hint")).to_contain_text("still coming")
    expect(page.locator("#chat-input")).to_have_value("And then?")
    page.click("#stop")
    expect(page.locator(".msg.assistant").last.locator(".stats")).to_contain_text("stopped", timeout=30_000)
    assert_clean(page)


def test_a_chat_runs_while_a_completion_streams(fast_server, page):
    boot(page, fast_server.url)
    page.fill("#max-tokens", "2000")
    page.fill("#extra", json.dumps({**LINES, "guided_regex": LINES["guided_regex"].replace("{60}", "{150}")}))
    page.click("button[data-tab=complete]")
    page.fill("#prompt", "Pangrams:\n")
    page.click("#complete-go")
    expect(page.locator("#completion")).to_contain_text("quick brown fox", timeout=60_000)
    page.click("button[data-tab=chat]")
    page.fill("#max-tokens", "8")
    page.fill("#extra", "")
    chat(page, "Hi")  # not ignored while the completion runs
    expect(page.locator(".msg.failed")).to_have_count(0)
    assert page.locator("#complete-stop").is_enabled()  # the completion was still running
    page.click("button[data-tab=complete]")
    page.click("#complete-stop")
    expect(page.locator("#completion-stats")).to_contain_text("stop", timeout=30_000)
    assert_clean(page)
