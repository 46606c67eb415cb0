"""The console's browser fixtures: Debian's chromium driven by Playwright, and a page at each width."""
from __future__ import annotations

import shutil

import pytest
from playwright.sync_api import sync_playwright

from models import load_model

from ..live_server import LiveServer
from .page_tools import WIDTHS, open_page


# a module's own: Playwright's sync API runs an event loop on this thread while it lives, and the worker
# goes on to other files, whose asyncio.run() would find it running
@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "chromium is missing: `make test` installs it (Debian package chromium)"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    page = open_page(browser)
    yield page
    page.context.close()


@pytest.fixture(params=list(WIDTHS))
def view(browser, request):
    """A page at each width: desktop 1280, tablet 768, phone 390."""
    page = open_page(browser, request.param)
    yield page
    page.context.close()


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["llama"]))


@pytest.fixture(scope="module")
def keyed_server(tiny_model):
    with LiveServer(tiny_model, api_keys=("key-alice", "key-bob")) as server:
        yield server

