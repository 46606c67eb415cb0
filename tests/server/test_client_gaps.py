"""What common clients send that kvserve once refused or answered oddly: vLLM's and llama-server's
/tokenize, the SDK's models.retrieve, browsers (CORS), HEAD probes, batched completion prompts, and
clear 400s for images and too many stop strings. Real servers, real clients."""
import json
import time

import httpx
import openai
import pytest

from server.listener import origin_list
from server.config import ServerConfig

from ..live_server import LiveServer, metric

MODEL = "smollm2-135m-instruct"
ORG_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # a served name with a "/"
KEY, ORIGIN = "secret-key", "https://app.example"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def client(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def error(r, status) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json()["error"]["message"]


@pytest.fixture(scope="module")
def guarded_server(served_model):
    """An API key, CORS for two origins, and a served name with a slash."""
    config = ServerConfig(model_name=ORG_MODEL, allowed_origins=(ORIGIN, "http://localhost:5173"))
    with LiveServer(served_model, api_keys=(KEY,), server_config=config) as server:
        yield server


# ---- /tokenize and /detokenize -----------------------------------------------------------------

def test_tokenize_takes_vllm_and_llama_server_fields(fast_server):
    url, tok = fast_server.url, fast_server.engine.tokenizer
    text = "Hello world, how are you?"
    want = tok.encode(text)
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r == {"count": len(want), "max_model_len": fast_server.engine.max_context, "tokens": want}
    assert httpx.post(url + "/tokenize", json={"content": text}).json()["tokens"] == tok.encode(text, add_special=False)
    assert httpx.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"] == want
    pieces = httpx.post(url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == want and "".join(p["piece"] for p in pieces) == text
    strs = httpx.post(url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()["token_strs"]
    assert len(strs) == len(want) and strs[1].lstrip("Ġ") == "world"

    back = httpx.post(url + "/detokenize", json={"model": MODEL, "tokens": want}).json()
    assert back == {"prompt": text, "content": text}


@pytest.mark.parametrize("extra", [{}, {"tools": [WEATHER]}, {"add_generation_prompt": False}])
def test_tokenize_messages_counts_the_chat_routes_prompt(fast_server, extra):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    r = httpx.post(fast_server.url + "/tokenize", json={"model": MODEL, "messages": messages, **extra}).json()
    chat = client(fast_server.url).chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0,
                                                           extra_body=extra)
    assert r["count"] == len(r["tokens"]) == chat.usage.prompt_tokens
    text = fast_server.engine.tokenizer.decode(r["tokens"], skip_special=False)
    assert ("get_weather" in text) == ("tools" in extra)
    assert text.rstrip().endswith("assistant") == extra.get("add_generation_prompt", True)


def test_tokenize_refusals_say_why(fast_server):
    url = fast_server.url
    message = error(httpx.post(url + "/tokenize", json={"prompt": "hi", "chat_template": "{{ x }}"}), 400)
    assert "'chat_template' is not a field of /tokenize" in message and "change the output" not in message
    message = error(httpx.post(url + "/detokenize", json={"tokens": [1], "skip_special_tokens": True}), 400)
    assert "'skip_special_tokens' is not a field of /detokenize" in message
    assert "exactly one" in error(httpx.post(url + "/tokenize", json={"prompt": "a", "content": "b"}), 400)
    assert "exactly one" in error(httpx.post(url + "/tokenize", json={}), 400)
    assert "'other'" in error(httpx.post(url + "/tokenize", json={"model": "other", "prompt": "a"}), 404)
    assert "'other'" in error(httpx.post(url + "/detokenize", json={"model": "other", "tokens": [1]}), 404)
    assert "vocabulary" in error(httpx.post(url + "/detokenize", json={"tokens": [10**7]}), 400)


# ---- models, CORS, HEAD ------------------------------------------------------------------------

def test_models_retrieve_with_the_sdk(fast_server, guarded_server):
    assert client(fast_server.url).models.retrieve(MODEL).id == MODEL
    c = client(guarded_server.url, KEY)
    got = c.models.retrieve(ORG_MODEL)  # the SDK sends the "/" percent-encoded
    assert got.id == ORG_MODEL and got.object == "model" and got.model_dump()["max_model_len"] > 0
    assert c.models.list().data[0].id == ORG_MODEL
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("HuggingFaceTB/other")
    assert ORG_MODEL in e.value.body["message"]
    with pytest.raises(openai.AuthenticationError):
        client(guarded_server.url, "wrong").models.retrieve(ORG_MODEL)


def preflight(url, origin, headers="authorization, content-type, x-session-id"):
    return httpx.options(url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": headers})


def test_cors_preflight_needs_no_key_and_answers_only_listed_origins(guarded_server, fast_server):
    url = guarded_server.url
    r = preflight(url, ORIGIN)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type", "x-session-id"} <= allowed
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "access-control-allow-origin" not in preflight(url, "https://evil.example").headers
    # the browser SDKs send headers of their own
    sdk = preflight(url, ORIGIN, "x-api-key, anthropic-version, x-stainless-os")
    assert sdk.status_code == 200 and "x-stainless-os" in sdk.headers["access-control-allow-headers"].lower()

    body = {"model": ORG_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "retry-after" in r.headers["access-control-expose-headers"].lower()
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Origin": ORIGIN})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN  # the page can read why
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Origin": "https://evil.example"})
    assert r.status_code == 401 and "access-control-allow-origin" not in r.headers
    # off by default: no CORS headers at all
    assert "access-control-allow-origin" not in preflight(fast_server.url, ORIGIN).headers


def test_cors_any_origin_and_the_flag(served_model):
    assert origin_list(["https://a.example, https://b.example/", "*", "https://a.example"]) == (
        "https://a.example", "https://b.example", "*")
    with LiveServer(served_model, server_config=ServerConfig(model_name=MODEL, allowed_origins=("*",))) as server:
        r = httpx.get(server.url + "/v1/models", headers={"Origin": "https://anywhere.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert preflight(server.url, "https://anywhere.example").status_code == 200


def test_head_health_is_public_and_bodiless(fast_server, guarded_server):
    for url in (fast_server.url, guarded_server.url):
        r = httpx.head(url + "/health")
        assert r.status_code == 200 and r.content == b""
    assert httpx.get(guarded_server.url + "/v1/models").status_code == 401  # the rest stays guarded


# ---- several prompts in /v1/completions --------------------------------------------------------

PROMPTS = ["The capital of France is", "One, two, three,", "def fibonacci(n):"]


def greedy(c, prompt, **kw):
    return c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, **kw)


def test_a_list_of_prompts_answers_each_as_alone(fast_server):
    c, tok = client(fast_server.url), fast_server.engine.tokenizer
    alone = [greedy(c, p) for p in PROMPTS]
    texts = [a.choices[0].text for a in alone]
    both = greedy(c, PROMPTS, n=2)
    assert [ch.index for ch in both.choices] == list(range(2 * len(PROMPTS)))
    assert [ch.text for ch in both.choices] == [t for t in texts for _ in range(2)]  # index = prompt * n + choice
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    assert both.usage.total_tokens == both.usage.prompt_tokens + both.usage.completion_tokens

    ids = [tok.encode(p) for p in PROMPTS]
    assert [ch.text for ch in greedy(c, ids).choices] == texts  # lists of ids: several prompts
    one = greedy(c, ids[0])  # one list of ids: one prompt
    assert [ch.text for ch in one.choices] == texts[:1]
    long = greedy(c, tok.encode("word " * 300))  # more ids than a request may hold prompts
    assert len(long.choices) == 1 and long.usage.prompt_tokens >= 300
    echoed = greedy(c, PROMPTS[:2], echo=True, logprobs=1)
    assert [ch.text for ch in echoed.choices] == [p + t for p, t in zip(PROMPTS[:2], texts)]
    # the echoed prompt's tokens come first in the logprobs, then the reply's
    assert all(len(ch.logprobs.tokens) == a.usage.prompt_tokens + a.usage.completion_tokens
               for ch, a in zip(echoed.choices, alone))


def test_a_list_of_prompts_streams_by_choice_index(fast_server):
    c = client(fast_server.url)
    texts = [greedy(c, p).choices[0].text for p in PROMPTS]
    chunks = list(greedy(c, PROMPTS, n=2, stream=True, stream_options={"include_usage": True}))
    got, reasons = [""] * 6, [None] * 6
    for chunk in chunks:
        for ch in chunk.choices:
            got[ch.index] += ch.text
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert got == [t for t in texts for _ in range(2)]
    assert all(r in ("stop", "length") for r in reasons)
    assert chunks[-1].usage.prompt_tokens == sum(greedy(c, p).usage.prompt_tokens for p in PROMPTS)


def test_a_list_of_prompts_is_refused_whole(fast_server):
    url = fast_server.url
    body = {"prompt": ["fine", [1, 2, 10**8]], "max_tokens": 2}
    assert "prompt must be" in error(httpx.post(url + "/v1/completions", json=body), 400)
    assert "prompt 1 of the list is empty" in error(httpx.post(url + "/v1/completions", json={"prompt": ["a", ""]}), 400)
    assert "at most 256 prompts" in error(httpx.post(url + "/v1/completions", json={"prompt": ["a"] * 257}), 400)
    r = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"]}, headers={"x-session-id": "s" * 22})
    assert "session" in error(r, 400)
    # the first prompt passes and starts a long reply; the second's refusal cancels it
    body = {"prompt": [[1, 2], [1, 2, 10**8]], "max_tokens": 4000, "ignore_eos": True}
    assert "vocabulary" in error(httpx.post(url + "/v1/completions", json=body), 400)
    deadline = time.monotonic() + 10
    while metric(url, "kvserve:num_requests_running") + metric(url, "kvserve:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the started prompt kept running"
        time.sleep(0.05)
    assert httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200


# ---- clear 400s --------------------------------------------------------------------------------

@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_image", "image_url": "https://x.example/a.png"},
    {"type": "image", "source": {"type": "url", "url": "https://x.example/a.png"}},
])
def test_image_parts_are_refused_by_name(fast_server, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    message = error(httpx.post(fast_server.url + "/v1/chat/completions", json={"messages": messages}), 400)
    assert "image inputs are not supported" in message and "valid string" not in message
    with pytest.raises(openai.BadRequestError) as e:
        client(fast_server.url).chat.completions.create(model=MODEL, messages=messages)
    assert "image inputs are not supported" in e.value.body["message"]


@pytest.mark.parametrize("part,words", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "type 'input_audio' are not supported"),
    ({"type": {"nested": 1}, "text": "x"}, "each content part is an object with a 'type'"),
    ("just a string", "each content part is an object with a 'type'"),
])
def test_other_content_parts_get_one_clear_error(fast_server, part, words):
    messages = [{"role": "user", "content": [part]}]
    message = error(httpx.post(fast_server.url + "/v1/chat/completions", json={"messages": messages}), 400)
    assert words in message and "more problems" not in message


def test_too_many_stop_strings_names_the_limit(fast_server):
    body = {"prompt": "hi", "stop": [f"s{i}" for i in range(2000)]}
    message = error(httpx.post(fast_server.url + "/v1/completions", json=body), 400)
    assert "64" in message and "2000" in message
    body = {"messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 65}
    assert "64" in error(httpx.post(fast_server.url + "/v1/chat/completions", content=json.dumps(body)), 400)
