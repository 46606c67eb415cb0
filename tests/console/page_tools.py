"""What the console's browser tests share: the widths the console is made for, a page at one of them, its
screenshots, and the check that a run logged no errors."""
from __future__ import annotations

import os
import re
from pathlib import Path

from playwright.sync_api import expect

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = {"desktop": (1280, 800), "tablet": (768, 1024), "phone": (390, 844)}
# The README's screenshots, written into docs/ by KVSERVE_SCREENSHOTS=1 (every run writes them under tmp)
README_SHOTS = {"console-chat.png", "console-live.png", "console-phone.png"}
# Chromium itself logs every fetch answered with an error status or not answered at all, as a console error
# no page can prevent. A test that causes one (a key asked for, a refused turn, a deleted session, an
# outage) names it; any other console error, and any uncaught exception, fails the test.
NETWORK = {"refused": r"Failed to load resource: net::ERR_CONNECTION_REFUSED",
           "400": r"Failed to load resource: the server responded with a status of 400 \(Bad Request\)",
           "401": r"Failed to load resource: the server responded with a status of 401 \(Unauthorized\)",
           "404": r"Failed to load resource: the server responded with a status of 404 \(Not Found\)"}


def open_page(browser, width: str = "desktop", **options):
    w, h = WIDTHS[width]
    context = browser.new_context(viewport={"width": w, "height": h}, is_mobile=width == "phone",
                                  has_touch=width == "phone", **options)
    page = context.new_page()
    page.width_name = width
    page.console_errors, page.exceptions = [], []
    page.on("console", lambda m: m.type == "error" and page.console_errors.append(m.text))
    page.on("pageerror", lambda e: page.exceptions.append(str(e)))
    return page


def assert_clean(page, *network: str) -> None:
    """No uncaught exception, and no console error but the browser's own reports of the failed fetches named."""
    assert page.exceptions == [], page.exceptions
    allowed = [re.compile(NETWORK[n]) for n in network]
    unexpected = [m for m in page.console_errors if not any(a.fullmatch(m) for a in allowed)]
    assert unexpected == [], unexpected


def screenshot(page, name: str, tmp_path: Path) -> Path:
    """Every run takes its screenshots; KVSERVE_SCREENSHOTS=1 writes the README's into docs/ (committed)."""
    folder = ROOT / "docs" if os.environ.get("KVSERVE_SCREENSHOTS") and name in README_SHOTS else tmp_path
    path = folder / name
    page.screenshot(path=str(path))
    assert path.stat().st_size > 10_000
    return path


def chat(page, text: str, timeout: float = 60_000):
    """Send a chat message and wait for its reply's figures (they come at its end)."""
    page.fill("#chat-input", text)
    page.click("#send")
    reply = page.locator(".msg.assistant").last
    expect(reply.locator(".stats")).to_contain_text("token", timeout=timeout)
    return reply


def settings(page) -> None:
    """Unfold the settings (folded on a phone)."""
    if not page.locator("#settings").evaluate("d => d.open"):
        page.click("#settings summary")


def boot(page, url: str) -> None:
    page.goto(url + "/")
    expect(page.locator("#connection-text")).to_have_text("live", timeout=20_000)
