"""The settings at each width: an empty field leaves the choice to the server, and a value out of range is
refused in the page, beside its field, before anything is sent."""
import json

import httpx
from playwright.sync_api import expect

from .page_tools import assert_clean, boot, chat, settings

VALID = {"#max-tokens": "8", "#temperature": "0.7", "#top-p": "1", "#seed": "", "#extra": ""}


def chat_bodies(page) -> list[dict]:
    bodies = []
    page.on("request", lambda r: r.method == "POST" and r.url.endswith("/v1/chat/completions")
            and bodies.append(json.loads(r.post_data)))
    return bodies


def test_empty_fields_are_the_servers_default(fast_server, view):
    page, bodies = view, chat_bodies(view)
    boot(page, fast_server.url)
    settings(page)
    for field in ("#max-tokens", "#temperature", "#top-p"):
        page.fill(field, "")
    page.fill("#extra", json.dumps({"guided_regex": "Hello there\\."}))  # a reply that ends by itself
    reply = chat(page, "Hi")
    assert not {"max_tokens", "temperature", "top_p"} & set(bodies[-1])  # not max_tokens: 0
    expect(reply.locator(".body")).to_have_text("Hello there.")
    expect(reply.locator(".stats")).to_contain_text("· stop")
    assert_clean(page)


def test_a_value_out_of_range_is_refused_beside_its_field(fast_server, view):
    page, bodies = view, chat_bodies(view)
    context = httpx.get(fast_server.url + "/v1/status").json()["max_context"]
    boot(page, fast_server.url)
    settings(page)
    for field, value in VALID.items():
        page.fill(field, value)
    refusals = [
        ("#max-tokens", str(context + 1), f"Max tokens must be a whole number from 1 to {context}"),
        ("#max-tokens", "0", f"Max tokens must be a whole number from 1 to {context}"),
        ("#max-tokens", "2.5", f"Max tokens must be a whole number from 1 to {context}"),
        ("#temperature", "3", "Temperature must be from 0 to 2"),
        ("#top-p", "0", "Top-p must be above 0 and at most 1"),
        ("#seed", "-1", "Seed must be a whole number from 0 to"),
        ("#extra", "{oops", "Extra request fields are not valid JSON"),
        ("#extra", "[1, 2]", "Extra request fields must be a JSON object"),
    ]
    page.fill("#chat-input", "Hi")
    for field, value, message in refusals:
        page.fill(field, value)
        page.click("#send")
        expect(page.locator(".field-error")).to_contain_text(message)
        expect(page.locator(field)).to_have_attribute("aria-invalid", "true")
        expect(page.locator(".field-error")).to_be_in_viewport()  # unfolded and scrolled to, on a phone too
        page.fill(field, VALID[field])  # editing takes the message away
        expect(page.locator(".field-error")).to_have_count(0)
    assert bodies == [] and page.locator(".msg").count() == 0  # nothing was sent
    expect(page.locator("#chat-input")).to_have_value("Hi")  # nor was the message lost
    assert page.locator("#max-tokens").get_attribute("max") == str(context)
    assert_clean(page)
