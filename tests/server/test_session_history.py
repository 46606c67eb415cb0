"""GET /v1/sessions/{id} gives a session's history back: its text, and the chat turns that render to it, so a
client (the console) can show a conversation and continue it without overwriting it."""
import dataclasses

import httpx

from models.tokenizer import TextTokenizer
from server.api import session_history

from .chat_templates import LLAMA3, QWEN3


def chat(url, sid, messages, n=8):
    r = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": sid}, timeout=120,
                   json={"messages": messages, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_a_chat_session_reads_back_as_its_turns_and_resending_them_continues_it(fast_server):
    url = fast_server.url
    sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    reply = chat(url, sid, first)
    got = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert got["messages"] == [*first, {"role": "assistant", "content": reply}]
    assert got["text"].startswith("<|im_start|>system\nBe brief.<|im_end|>") and got["text"].endswith(reply + "<|im_end|>")
    # what a client resends with a new turn keeps the whole history: it grows, nothing of it is replaced
    chat(url, sid, [*got["messages"], {"role": "user", "content": "And another?"}])
    after = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert after["text"].startswith(got["text"]) and after["length"] > got["length"]
    assert after["messages"][: len(got["messages"])] == got["messages"] and len(after["messages"]) == 5
    httpx.delete(f"{url}/v1/sessions/{sid}")


def test_a_forked_session_reads_back_as_its_parents_turns(fast_server):
    url = fast_server.url
    sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    reply = chat(url, sid, [{"role": "user", "content": "My name is Ada."}])
    fork = httpx.post(f"{url}/v1/sessions/{sid}/fork").json()["id"]
    got = httpx.get(f"{url}/v1/sessions/{fork}").json()
    # the template writes its default system prompt when a chat has none: it is part of the history
    assert [m["role"] for m in got["messages"]] == ["system", "user", "assistant"]
    assert got["messages"][1:] == [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": reply}]
    for s in (sid, fork):
        httpx.delete(f"{url}/v1/sessions/{s}")


def test_text_that_is_no_chat_has_text_only_and_an_empty_session_has_no_turns(fast_server):
    url = fast_server.url
    sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    empty = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert (empty["text"], empty["messages"], empty["length"]) == ("", [], 0)
    r = httpx.post(url + "/generate", json={"inputs": "The history of the bicycle began", "session_id": sid,
                                            "parameters": {"max_new_tokens": 6}}, timeout=120).json()
    got = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert got["messages"] is None
    assert got["text"] == "The history of the bicycle began" + r["generated_text"]
    httpx.delete(f"{url}/v1/sessions/{sid}")


def test_an_unknown_session_is_a_typed_404_in_the_error_shape(fast_server):
    r = httpx.get(fast_server.url + "/v1/sessions/no-such-session-id-at-all-here")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no session 'no-such-session-id-at-all-here'", "type": "not_found_error",
                                  "param": "session_id", "code": 404}}


def test_a_cut_reply_and_a_bare_generation_prompt_read_back_as_turns(fast_server):
    tok = fast_server.engine.tokenizer
    asked = [{"role": "user", "content": "Hi"}]
    prompt = tok.encode(tok.apply_chat_template(asked, True), add_special=False)
    assert session_history.history(tok, prompt)["messages"][1:] == asked  # a turn with no reply yet
    cut = session_history.history(tok, prompt + tok.encode("Hello th", add_special=False))["messages"]
    assert cut[-1] == {"role": "assistant", "content": "Hello th"}  # a reply cut by max_tokens or Stop


def test_a_template_that_rewrites_its_turns_gives_text_only(fast_server):
    """Llama 3.2 dates its system prompt, Qwen3 moves think blocks: resending what was read would not
    render the same text, so no messages are offered."""
    tok = fast_server.engine.tokenizer
    for template in (LLAMA3, QWEN3):
        other = TextTokenizer(tok.tokenizer, dataclasses.replace(tok.meta, chat_template=template))
        text = other.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}], False)
        got = session_history.history(other, other.encode(text, add_special=False))
        assert got["messages"] is None and got["text"] == text
