"""An outage at each width: the server stops under an open console and comes back on its port. The header
says so in one place, the live view's stale figures are greyed and dated, errors read as errors, and
the page recovers by itself; the session the restart lost is said plainly."""
import contextlib

import httpx
from playwright.sync_api import expect

from ..live_server import LiveServer
from .page_tools import assert_clean, boot, chat, screenshot, settings

RED = "rgb(180, 35, 24)"


def opacity(page, selector: str) -> float:
    return float(page.locator(selector).first.evaluate("e => getComputedStyle(e).opacity"))


def test_an_outage_is_shown_in_one_place_and_the_console_recovers(tiny_model, view, tmp_path):
    page = view
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(LiveServer(tiny_model))
        boot(page, server.url)
        settings(page)
        page.select_option("#session-mode", "new")
        page.fill("#max-tokens", "4")
        chat(page, "Hi")
        sid = httpx.post(server.url + "/v1/sessions", json={}).json()["id"]
        page.click("button[data-tab=live]")
        expect(page.locator(f'tr[data-id="{sid}"]')).to_be_visible(timeout=5_000)
        assert opacity(page, "#live .figures") == 1 and page.locator("#stale-note").is_hidden()

        stack.close()  # the server stops
        expect(page.locator("#connection-text")).to_contain_text("reconnecting", timeout=15_000)
        expect(page.locator("#connection-text")).to_contain_text("server unreachable", timeout=30_000)
        assert page.locator("#connection").evaluate("e => getComputedStyle(e).color") == RED
        expect(page.locator("#stale-note")).to_contain_text("last figures the server gave")
        assert opacity(page, "#live .figures") < 0.5  # stale: greyed, still there to read
        expect(page.locator(f'tr[data-id="{sid}"]')).to_be_visible()
        screenshot(page, f"console-outage-{page.width_name}.png", tmp_path)
        page.click("button[data-tab=chat]")
        page.fill("#chat-input", "Anyone there?")
        page.click("#send")
        failed = page.locator(".msg.assistant.failed .stats")
        expect(failed).to_contain_text("the server is unreachable", timeout=15_000)  # not "Failed to fetch"
        assert failed.evaluate("e => getComputedStyle(e).color") == RED

        stack.enter_context(LiveServer(tiny_model, port=server.port))  # back on its port, its sessions gone
        expect(page.locator("#connection-text")).to_have_text("live", timeout=30_000)
        page.click("button[data-tab=live]")
        expect(page.locator("#stale-note")).to_be_hidden()
        assert opacity(page, "#live .figures") == 1
        expect(page.locator(f'tr[data-id="{sid}"]')).to_have_count(0)  # the restart lost it: current figures
        page.click("button[data-tab=chat]")
        page.locator(".msg.assistant.failed").get_by_role("button", name="Retry").click()
        expect(page.locator(".msg.assistant.failed .stats")).to_contain_text("This session no longer exists", timeout=30_000)
        page.locator(".msg.assistant.failed").get_by_role("button", name="Start a new session").click()
        expect(page.locator(".msg.assistant").last.locator(".stats")).to_contain_text("token", timeout=60_000)
        expect(page.locator(".msg.failed")).to_have_count(0)
    assert_clean(page, "refused", "404")
