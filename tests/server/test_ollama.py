"""Ollama's API, through the official `ollama` client and raw NDJSON: the same generation path as the
OpenAI routes (greedy text equal), Ollama's figures and reasons, formats, tools, and its error shape."""
import json
import logging

import httpx
import ollama
import pytest

from ..live_server import LiveServer, metric

MODEL = "smollm2-135m-instruct"
GREEDY = {"temperature": 0}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(fast_server):
    return ollama.Client(host=fast_server.url)


def openai_text(url, path, **body):
    r = httpx.post(url + path, json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"], r.json()["usage"]


def ndjson(url, path, body):
    """The raw stream: its content type and every line, each one JSON object."""
    with httpx.stream("POST", url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return r.headers["content-type"], [json.loads(line) for line in r.iter_lines() if line]


def test_raw_generate_is_the_openai_completion_with_ollama_figures(client, fast_server):
    text, usage = openai_text(fast_server.url, "/v1/completions", prompt="1, 2, 3, 4,", max_tokens=6)
    r = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={**GREEDY, "num_predict": 6})
    assert r.response == text
    assert r.done and r.done_reason == "length" and r.eval_count == 6
    assert r.prompt_eval_count == usage["prompt_tokens"]
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0 and r.load_duration == 0
    # the context is the whole history: sent back, it continues where the reply ended
    assert r.context[:usage["prompt_tokens"]] == fast_server.engine.tokenizer.encode("1, 2, 3, 4,")
    more = client.generate(model=MODEL, prompt="", raw=True, context=r.context, options={**GREEDY, "num_predict": 4})
    assert more.prompt_eval_count == len(r.context) and more.eval_count == 4
    whole, _ = openai_text(fast_server.url, "/v1/completions", prompt=r.context, max_tokens=4)
    assert more.response == whole


def test_chat_streams_ndjson_pieces_that_make_the_whole_reply(client, fast_server):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text, usage = openai_text(fast_server.url, "/v1/chat/completions", messages=messages, max_tokens=12)
    whole = client.chat(model=MODEL, messages=messages, options={**GREEDY, "num_predict": 12})
    assert whole.message.role == "assistant" and whole.message.content == text
    assert whole.prompt_eval_count == usage["prompt_tokens"] and whole.eval_count == usage["completion_tokens"]
    parts = list(client.chat(model=MODEL + ":latest", messages=messages, stream=True,
                             options={**GREEDY, "num_predict": 12}))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and len(parts) > 2
    assert "".join(p.message.content for p in parts) == text
    assert parts[-1].done_reason == whole.done_reason and parts[-1].eval_count == whole.eval_count

    kind, lines = ndjson(fast_server.url, "/api/chat", {"model": MODEL, "messages": messages,
                                                        "options": {**GREEDY, "num_predict": 12}})
    assert kind.startswith("application/x-ndjson")  # streams unless told not to, as Ollama does
    assert "".join(o["message"]["content"] for o in lines) == text
    assert {"model", "created_at", "message", "done"} <= set(lines[0]) and lines[0]["done"] is False
    end = lines[-1]
    assert end["done"] is True and end["created_at"].endswith("Z")
    for key in ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
                "eval_duration"):
        assert isinstance(end[key], int), key


def test_generate_templates_the_prompt_and_system(client, fast_server):
    tok = fast_server.engine.tokenizer
    r = client.generate(model=MODEL, prompt="Say hi.", system="You are terse.", options={**GREEDY, "num_predict": 8})
    turn = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    assert r.prompt_eval_count == len(tok.encode(tok.apply_chat_template(turn), add_special=False))
    chat = client.chat(model=MODEL, messages=turn, options={**GREEDY, "num_predict": 8})
    assert r.response == chat.message.content
    kind, lines = ndjson(fast_server.url, "/api/generate", {"model": MODEL, "prompt": "Say hi.", "system": "You are terse.",
                                                            "options": {**GREEDY, "num_predict": 8}})
    assert "".join(o["response"] for o in lines) == r.response and lines[-1]["context"] == r.context


def test_num_predict_num_ctx_and_stop_end_the_reply(client, fast_server):
    prompt = "1, 2, 3, 4,"
    n = len(fast_server.engine.tokenizer.encode(prompt))
    r = client.generate(model=MODEL, prompt=prompt, raw=True, options={**GREEDY, "num_ctx": n + 3})
    assert r.done_reason == "length" and r.eval_count == 3  # the window is full
    r = client.generate(model=MODEL, prompt=prompt, raw=True, options={**GREEDY, "num_predict": 12, "stop": [" 7"]})
    assert r.done_reason == "stop" and r.response == " 5, 6,"
    r = client.generate(model=MODEL, prompt=prompt, raw=True, options={"seed": 7, "temperature": 1.5, "num_predict": 6})
    again = client.generate(model=MODEL, prompt=prompt, raw=True, options={"seed": 7, "temperature": 1.5, "num_predict": 6})
    assert r.response == again.response


# Ollama's own defaults, as its clients send them (seeded, so replies can be compared)
OLLAMA_DEFAULTS = {"repeat_last_n": 64, "repeat_penalty": 1.1, "temperature": 0.8, "top_k": 40, "top_p": 0.9,
                   "seed": 11, "num_predict": 24}


@pytest.mark.parametrize("sampler", [{}, {"typical_p": 0.7}, {"mirostat": 2}, {"mirostat": 1, "mirostat_tau": 4.0}])
def test_ollamas_default_options_sample_seeded_and_alone_equals_batched(client, fast_server, sampler):
    options = {**OLLAMA_DEFAULTS, **sampler}
    messages = [{"role": "user", "content": "Write two sentences about a lighthouse keeper."}]
    drafts = metric(fast_server.url, "kvserve:spec_decode_num_drafts")
    first = client.chat(model=MODEL, messages=messages, options=options)
    assert first.message.content.strip() and first.eval_count > 0
    if "mirostat" in sampler:  # its mu moves after every token, so it never drafts
        assert metric(fast_server.url, "kvserve:spec_decode_num_drafts") == drafts
    assert client.chat(model=MODEL, messages=messages, options=options).message.content == first.message.content
    # the same request while another one decodes beside it, in the same steps
    other = {"model": MODEL, "prompt": "1, 2, 3, 4,", "raw": True, "options": {**GREEDY, "num_predict": 160}}
    with httpx.stream("POST", fast_server.url + "/api/generate", json=other, timeout=120) as running:
        lines = running.iter_lines()
        assert not json.loads(next(lines))["done"]  # it is decoding
        batched = client.chat(model=MODEL, messages=messages, options=options)
        rest = [json.loads(line) for line in lines if line]
    assert rest[-1]["eval_count"] == 160  # it ran on all along
    assert batched.message.content == first.message.content


def test_num_ctx_past_the_models_context_is_clamped_to_it_with_a_warning(client, fast_server, caplog):
    with caplog.at_level(logging.WARNING, logger="kvserve.ollama"):
        r = client.generate(model=MODEL, prompt="1, 2, 3,", raw=True, options={**GREEDY, "num_ctx": 10**6, "num_predict": 3})
    assert r.done and r.eval_count == 3
    assert any("num_ctx 1000000" in rec.getMessage() and str(fast_server.engine.max_context) in rec.getMessage()
               for rec in caplog.records)
    with pytest.raises(ollama.ResponseError) as err:  # a prompt that does not fit is still refused
        client.generate(model=MODEL, prompt="1, 2, 3, 4, 5, 6,", raw=True, options={**GREEDY, "num_ctx": 3})
    assert err.value.status_code == 400 and "num_ctx" in err.value.error


def test_format_json_and_a_schema_constrain_the_output(client):
    messages = [{"role": "user", "content": "Give me a JSON object describing a city."}]
    r = client.chat(model=MODEL, messages=messages, format="json", options={**GREEDY, "num_predict": 64})
    assert isinstance(json.loads(r.message.content), dict)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "people": {"type": "integer"}},
              "required": ["city", "people"], "additionalProperties": False}
    r = client.generate(model=MODEL, prompt="Name a city and its population.", format=schema,
                        options={**GREEDY, "num_predict": 64})
    out = json.loads(r.response)
    assert set(out) == {"city", "people"} and isinstance(out["city"], str) and isinstance(out["people"], int)


def _weather_history():
    """Two earlier calls, their results and answers: the small model then calls the tool for Paris too."""
    def call(city):
        return {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                 "arguments": {"city": city}}}]}

    return [{"role": "user", "content": "What is the weather in London?"}, call("London"),
            {"role": "tool", "content": "15 C, cloudy", "tool_name": "get_weather"},
            {"role": "assistant", "content": "It is 15 C and cloudy in London."},
            {"role": "user", "content": "What is the weather in Berlin?"}, call("Berlin"),
            {"role": "tool", "content": "20 C, sunny", "tool_name": "get_weather"},
            {"role": "assistant", "content": "It is 20 C and sunny in Berlin."},
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_come_back_in_ollamas_shape(client, stream):
    out = client.chat(model=MODEL, messages=_weather_history(), tools=WEATHER, stream=stream,
                      options={**GREEDY, "num_predict": 40})
    parts = list(out) if stream else [out]
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert "<tool_call>" not in "".join(p.message.content or "" for p in parts)  # the markup is never content
    assert parts[-1].done and parts[-1].done_reason == "stop"


def test_tags_show_ps_and_version_describe_the_served_model(client, fast_server):
    models = client.list().models
    assert [m.model for m in models] == [MODEL + ":latest"]
    d = models[0].details
    assert d.family == "llama" and d.parameter_size.endswith("M") and d.quantization_level and models[0].size > 0
    shown = client.show(MODEL + ":latest")
    assert shown.modelinfo["llama.context_length"] == fast_server.engine.max_context
    assert "temperature" in shown.parameters and "<|im_start|>" in shown.template
    assert [m.context_length for m in client.ps().models] == [fast_server.engine.max_context]
    assert httpx.get(fast_server.url + "/api/version").json()["version"].count(".") == 2
    loaded = client.generate(model=MODEL)  # what clients send to load a model
    assert loaded.done and loaded.done_reason == "load"


@pytest.mark.parametrize("body, status, words", [
    ({"model": "llama3", "messages": [{"role": "user", "content": "hi"}]}, 404, "not found"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "image inputs"),
    ({"model": MODEL, "messages": [], "options": {"bogus": 1}}, 400, "'bogus' is not a known field"),
    ({"model": MODEL, "messages": [], "options": {"mirostat": 3}}, 400, "mirostat"),
    ({"model": MODEL, "messages": [], "options": {"tfs_z": 0.95}}, 400, "tfs_z"),
    ({"model": MODEL, "messages": [], "options": {"temperature": -1}}, 400, "temperature"),
    ({"model": MODEL, "messages": [], "think": True}, 400, "think"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "format": "json", "tools": WEATHER}, 400, "format"),
])
def test_chat_errors_take_ollamas_shape(fast_server, body, status, words):
    r = httpx.post(fast_server.url + "/api/chat", json=body)
    assert r.status_code == status and list(r.json()) == ["error"] and words in r.json()["error"], r.text


@pytest.mark.parametrize("fields, words", [
    ({"suffix": "y"}, "suffix"),
    ({"template": "{{ .Prompt }}"}, "template"),
    ({"images": ["aGk="]}, "image inputs"),
    ({"logprobs": True}, "logprobs"),
])
def test_generate_refuses_what_it_does_not_implement(client, fields, words):
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=MODEL, prompt="x", **fields)
    assert err.value.status_code == 400 and words in err.value.error


def test_the_client_sees_a_missing_model_and_unknown_routes_as_ollama_errors(client, fast_server):
    for call in (lambda: client.chat(model="llama3", messages=[{"role": "user", "content": "hi"}]),
                 lambda: client.show("llama3:8b")):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 404 and "llama3" in err.value.error
    r = httpx.post(fast_server.url + "/api/no-such-route", json={"model": MODEL})  # model management: 501 (test_embeddings.py)
    assert r.status_code in (404, 405) and isinstance(r.json()["error"], str)
    assert isinstance(httpx.post(fast_server.url + "/v1/completions", json={}).json()["error"], dict)  # OpenAI's own


def test_api_keys_guard_the_ollama_routes_in_ollamas_shape(served_model):
    with LiveServer(served_model, api_keys=("key-a",), name=MODEL) as server:
        with pytest.raises(ollama.ResponseError) as err:
            ollama.Client(host=server.url).list()
        assert err.value.status_code == 401 and err.value.error == "missing API key"
        keyed = ollama.Client(host=server.url, headers={"Authorization": "Bearer key-a"})
        assert [m.model for m in keyed.list().models] == [MODEL + ":latest"]
        assert httpx.head(server.url + "/").status_code == 200  # the probe that a server is up needs no key, as GET /


def test_head_root_answers_and_get_root_stays_the_console(fast_server):
    r = httpx.head(fast_server.url + "/")
    assert r.status_code == 200 and r.content == b""
    page = httpx.get(fast_server.url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")


@pytest.mark.parametrize("keep_alive", [0, "0", "0s", "0m0s"])
def test_keep_alive_zero_without_a_prompt_unloads(client, keep_alive):
    assert client.generate(model=MODEL, keep_alive=keep_alive).done_reason == "unload"
    chat = client.chat(model=MODEL, messages=[], keep_alive=keep_alive)
    assert chat.done and chat.done_reason == "unload" and chat.message.content == ""
    assert client.generate(model=MODEL, keep_alive="5m").done_reason == "load"


def test_keep_alive_zero_with_a_prompt_generates_as_usual(client):
    r = client.generate(model=MODEL, prompt="1, 2, 3,", raw=True, keep_alive=0, options={**GREEDY, "num_predict": 3})
    assert r.done_reason == "length" and r.response
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], keep_alive=0,
                    options={**GREEDY, "num_predict": 2})
    assert r.done_reason == "length"
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model=MODEL, keep_alive="5")  # a duration needs its unit, as Ollama parses it
    assert err.value.status_code == 400 and "keep_alive" in err.value.error
