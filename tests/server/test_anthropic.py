"""Anthropic's Messages API on the real model, through the official anthropic SDK."""
import json

import anthropic
import httpx
import jsonschema
import pytest

from server.config import EngineConfig

from ..live_server import LiveServer

MODEL = "smollm2-135m-instruct"
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "The local time in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments; older ones send them as fields like this


@pytest.fixture(scope="module")
def client(fast_server):
    return anthropic.Anthropic(base_url=fast_server.url, api_key="unused", max_retries=0)


def ask(client, content="Name three colours.", **kw):
    kw.setdefault("max_tokens", 16)
    kw["extra_body"] = {**GREEDY, **kw.get("extra_body", {})}
    messages = [{"role": "user", "content": content}] if isinstance(content, str) else content
    return client.messages.create(model=MODEL, messages=messages, **kw)


def test_create_gives_a_message_with_usage_and_cached_prefix(client):
    system = "You are a terse assistant who answers in one short sentence about the colours of the rainbow."
    first = ask(client, system=system, metadata={"user_id": "u-1"})
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.model == MODEL and [b.type for b in first.content] == ["text"] and first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens") and first.stop_sequence is None
    assert 0 < first.usage.output_tokens <= 16 and first.usage.cache_creation_input_tokens == 0
    counted = client.messages.count_tokens(model=MODEL, system=system,
                                           messages=[{"role": "user", "content": "Name three colours."}])
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == counted.input_tokens > 20
    # the same prompt again: its prefix comes from the cache, counted apart as Anthropic does
    again = ask(client, system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}])
    assert again.usage.cache_read_input_tokens >= 16 and again.content[0].text == first.content[0].text
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == counted.input_tokens


def test_max_tokens_and_stop_sequence_name_why_the_reply_stopped(client):
    r = ask(client, "Write a long story about a dragon.", max_tokens=3)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3
    full = ask(client, "Write a long story about a dragon.", max_tokens=24).content[0].text
    word = " " + full.split()[4]  # a word from the middle of the greedy reply
    cut = ask(client, "Write a long story about a dragon.", max_tokens=24, stop_sequences=["QQQ-never", word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == full[:full.index(word)] and word not in cut.content[0].text
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=24, stop_sequences=[word], messages=[
            {"role": "user", "content": "Write a long story about a dragon."}]) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, streamed.content[0].text) == \
        ("stop_sequence", word, cut.content[0].text)


def test_a_session_id_keeps_the_conversation_on_the_server(client, fast_server):
    sid = httpx.post(fast_server.url + "/v1/sessions", json={}).json()["id"]
    try:
        r = ask(client, "Hi there!", max_tokens=4, extra_body={"session_id": sid})
        length = httpx.get(fast_server.url + f"/v1/sessions/{sid}").json()["length"]
        assert length == r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.output_tokens
    finally:
        httpx.delete(fast_server.url + f"/v1/sessions/{sid}")


def test_a_stream_rebuilds_the_same_message(client):
    whole = ask(client, "Tell me about the sea.", max_tokens=20)
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=20,
                                messages=[{"role": "user", "content": "Tell me about the sea."}]) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 3 and "".join(pieces) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_the_raw_stream_follows_anthropics_event_grammar(fast_server):
    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Hello!"}]}
    with httpx.stream("POST", fast_server.url + "/v1/messages", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in r.read().decode().split("\n\n") if f]
    events = []
    for frame in frames:
        name, data = frame.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        events.append(payload)
    names = [e["type"] for e in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"] > 0
    assert 1 <= events[-2]["usage"]["output_tokens"] <= 8
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens")


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_time"}])
def test_a_required_tool_call_is_a_tool_use_block_whose_input_validates(client, choice):
    r = ask(client, ASK_WEATHER, tools=[WEATHER, TIME], tool_choice={**choice, "disable_parallel_tool_use": True},
            max_tokens=80)
    assert r.stop_reason == "tool_use" and [b.type for b in r.content] == ["tool_use"], r.content
    call = r.content[0]
    assert call.id.startswith("toolu_") and call.name in ({"get_time"} if choice["type"] == "tool" else set(SCHEMAS))
    jsonschema.validate(call.input, SCHEMAS[call.name])


def test_a_streamed_tool_use_sends_its_input_as_json_deltas(client):
    partials = []
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=80, messages=ASK_WEATHER, tools=[WEATHER],
                                tool_choice=choice) as stream:
        for ev in stream:
            assert ev.type != "text", ev  # no markup leaks as text
            if ev.type == "input_json":
                partials.append(ev.partial_json)
        final = stream.get_final_message()
    assert len(partials) >= 3, partials  # while it is generated, not as one piece at the end
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert json.loads("".join(partials)) == final.content[0].input
    jsonschema.validate(final.content[0].input, WEATHER["input_schema"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_tool_call_that_cannot_fit_max_tokens_is_refused(client, stream):
    """No call fits 12 tokens: an invalid_request_error naming what the shortest takes, not a cut reply."""
    kw = dict(model=MODEL, extra_body=GREEDY, max_tokens=12, messages=ASK_WEATHER, tools=[WEATHER],
              tool_choice={"type": "any"})
    with pytest.raises(anthropic.BadRequestError, match=r"shortest form takes \d+ tokens") as refused:
        if stream:
            with client.messages.stream(**kw) as s:
                s.get_final_message()
        else:
            client.messages.create(**kw)
    assert refused.value.body["error"]["type"] == "invalid_request_error"


def test_a_tool_loop_feeds_the_result_back_for_a_final_answer(client):
    first = ask(client, ASK_WEATHER, tools=[WEATHER], tool_choice={"type": "any", "disable_parallel_tool_use": True},
                max_tokens=80)
    call = first.content[0]
    assert first.stop_reason == "tool_use" and call.type == "tool_use"
    result = {"type": "tool_result", "tool_use_id": call.id,
              "content": [{"type": "text", "text": json.dumps({"temperature": 21, "sky": "clear"})}]}
    messages = [*ASK_WEATHER, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": [result]}]
    final = ask(client, messages, tools=[WEATHER], max_tokens=30)
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    assert "<tool_call>" not in final.content[0].text
    # the call and its result went into the prompt
    grown = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert grown > first.usage.input_tokens + first.usage.cache_read_input_tokens + 20
    assert client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER]).input_tokens == grown


def test_count_tokens_counts_tools_and_a_prefill_continues_the_reply(client):
    plain = client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER).input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK_WEATHER, tools=[WEATHER, TIME]).input_tokens
    assert with_tools > plain + 40
    r = ask(client, [{"role": "user", "content": "Count from one to ten."},
                     {"role": "assistant", "content": "One, two, three,"}], max_tokens=6)
    assert "four" in r.content[0].text.lower() and not r.content[0].text.startswith("One")


@pytest.mark.parametrize("kw, why", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048}, "this model's chat template has no thinking"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "image inputs are not supported"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_date"}}, "get_date"),
    ({"tool_choice": {"type": "any"}}, "tool_choice needs tools"),
])
def test_bad_requests_get_a_400_in_anthropics_shape(client, kw, why):
    kw = {"messages": ASK_WEATHER, "max_tokens": 8, **kw}
    with pytest.raises(anthropic.BadRequestError, match=why) as e:
        client.messages.create(model=MODEL, **kw)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and why in e.value.body["error"]["message"]


def test_an_unknown_model_and_path_are_not_found_errors(client, fast_server):
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=ASK_WEATHER)
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in e.value.body["error"]["message"]
    r = httpx.post(fast_server.url + "/v1/messages/batches", json={})
    assert r.status_code in (404, 405) and r.json()["type"] == "error"
    # other routes keep their own shape
    assert "type" not in httpx.post(fast_server.url + "/v1/chat/completions", json={}).json()


class FailNextStep:
    """The engine's runner, wrapped by the test: once armed, its next step fails after the forward."""

    def __init__(self, runner) -> None:
        self.runner, self.armed = runner, False

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def run(self, batch):
        out = self.runner.run(batch)
        if self.armed:
            self.armed = False
            raise RuntimeError("fault injected by the test")
        return out


def test_keys_failures_and_a_full_server_in_anthropics_shape(served_model):
    with LiveServer(served_model, EngineConfig(max_running=1, max_queued=1), api_keys=("key-a",)) as server:
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=server.url, api_key="key-b", max_retries=0).messages.count_tokens(
                model=MODEL, messages=ASK_WEATHER)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}
        good = anthropic.Anthropic(base_url=server.url, api_key="key-a", max_retries=0)  # sends x-api-key
        assert good.messages.count_tokens(model=MODEL, messages=ASK_WEATHER).input_tokens > 0
        bearer = anthropic.Anthropic(base_url=server.url, auth_token="key-a", max_retries=0)  # Authorization: Bearer
        assert bearer.messages.count_tokens(model=MODEL, messages=ASK_WEATHER).input_tokens > 0

        server.engine.runner = runner = FailNextStep(server.engine.runner)
        runner.armed = True
        with pytest.raises(anthropic.InternalServerError) as e:
            good.messages.create(model=MODEL, max_tokens=4, messages=ASK_WEATHER)
        assert e.value.body["error"]["type"] == "api_error" and "fault" in e.value.body["error"]["message"]
        runner.armed = True
        with pytest.raises(anthropic.APIStatusError) as e:  # midway, as an error event
            with good.messages.stream(model=MODEL, max_tokens=4, messages=ASK_WEATHER) as stream:
                list(stream)
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"

        long = dict(model=MODEL, max_tokens=400, messages=[{"role": "user", "content": "Write a very long story."}])
        with good.messages.stream(**long), good.messages.stream(**long):  # one runs, one waits: the server is full
            with pytest.raises(anthropic.RateLimitError) as e:
                good.messages.create(**long)
        assert e.value.body["error"]["type"] == "rate_limit_error" and int(e.value.response.headers["retry-after"]) >= 1


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "What is the weather in Paris, Rome and Oslo?"])
def test_parallel_tool_calls_stream_as_one_block_each(client, question):
    starts = []
    with client.messages.stream(model=MODEL, extra_body=GREEDY, max_tokens=120, tools=[WEATHER],
                                messages=[{"role": "user", "content": question}], tool_choice={"type": "any"}) as stream:
        for ev in stream:
            if ev.type == "content_block_start":
                starts.append(ev.index)
        final = stream.get_final_message()
    assert starts == list(range(len(final.content))) and final.content
    assert final.stop_reason in ("tool_use", "max_tokens")
    complete = final.content if final.stop_reason == "tool_use" else final.content[:-1]  # the last may be cut
    for block in complete:
        assert block.type == "tool_use" and block.name == "get_weather"
        jsonschema.validate(block.input, WEATHER["input_schema"])


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("max_tokens", [24, 200])
@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_structured_output_is_json_matching_the_schema_within_max_tokens(client, field, max_tokens):
    fmt = {"type": "json_schema", "schema": PERSON}
    extra = {"output_config": {"format": fmt}} if field == "output_config" else {"output_format": fmt}
    m = ask(client, "Describe a person as JSON.", max_tokens=max_tokens, extra_body=extra)
    assert [b.type for b in m.content] == ["text"] and m.usage.output_tokens <= max_tokens
    jsonschema.validate(json.loads(m.content[0].text), PERSON)
    with client.messages.stream(model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": "A person."}],
                                extra_body={**GREEDY, **extra}) as stream:
        text = "".join(stream.text_stream)
    jsonschema.validate(json.loads(text), PERSON)


def test_structured_output_and_a_forced_tool_cannot_both_constrain(client):
    with pytest.raises(anthropic.BadRequestError, match="cannot both constrain"):
        ask(client, tools=[WEATHER], tool_choice={"type": "any"},
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": PERSON}}})
