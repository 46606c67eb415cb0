"""Anthropic's checks beyond the fields' shapes, through the anthropic SDK on a real server: turns around
tool calls (consecutive same-role messages are one turn), unknown content blocks, and tools' input schemas."""
import anthropic
import pytest

MODEL = "smollm2-135m-instruct"
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                          "input": {"city": "Paris"}}]}


def result(tool_use_id="toolu_1"):
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": "21 degrees"}


@pytest.fixture(scope="module")
def client(fast_server):
    return anthropic.Anthropic(base_url=fast_server.url, api_key="unused", max_retries=0)


def refused(client, why, **kw):
    kw.setdefault("tools", [WEATHER])
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.count_tokens(model=MODEL, **kw)
    body = e.value.body
    assert e.value.status_code == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert why in body["error"]["message"], body
    return body["error"]["message"]


def test_conversations_anthropic_takes(client):
    turns = [
        [{"role": "assistant", "content": "How can I help?"}, ASK],  # a first turn may be the assistant's
        [ASK, {"role": "user", "content": "And in Rome?"}],  # consecutive messages of one role are one turn
        [ASK, CALL, {"role": "user", "content": [result()]}],
        # the results may come in two messages of the one user turn, with text after them
        [ASK, {**CALL, "content": [*CALL["content"], {**CALL["content"][0], "id": "toolu_2"}]},
         {"role": "user", "content": [result()]},
         {"role": "user", "content": [result("toolu_2"), {"type": "text", "text": "Thanks"}]}],
        [ASK, CALL],  # the call as the last turn: nothing has followed it yet
    ]
    for messages in turns:
        assert client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER]).input_tokens > 0


def test_a_tool_result_answers_a_call_of_the_turn_before(client):
    message = refused(client, "unexpected `tool_use_id` found in `tool_result` blocks: toolu_9",
                      messages=[ASK, CALL, {"role": "user", "content": [result(), result("toolu_9")]}])
    assert message.startswith("messages.2.content.1:")
    refused(client, "toolu_1", messages=[{"role": "user", "content": [result()]}])  # no call before it at all
    # the call two turns back is not the turn before
    refused(client, "toolu_1", messages=[ASK, CALL, {"role": "user", "content": [result()]},
                                         {"role": "assistant", "content": "It is warm."},
                                         {"role": "user", "content": [result()]}])
    message = refused(client, "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_1",
                      messages=[ASK, CALL, {"role": "user", "content": "Never mind."}])
    assert message.startswith("messages.1:")


def test_an_unknown_content_block_is_named(client):
    refused(client, "content block 1 has type 'search_result'",
            messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                   {"type": "search_result", "source": "x", "title": "x", "content": []}]}])
    refused(client, "content block 0.content.0 has type 'foo'",
            messages=[ASK, CALL, {"role": "user", "content": [{**result(), "content": [{"type": "foo"}]}]}])
    refused(client, "content block 0 has type 'image'", messages=[ASK],
            system=[{"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}])
    with pytest.raises(anthropic.BadRequestError, match="messages: List should have at least 1 item"):
        client.messages.count_tokens(model=MODEL, messages=[])


@pytest.mark.parametrize("choice", [None, {"type": "auto"}, {"type": "none"}, {"type": "any"},
                                    {"type": "tool", "name": "get_weather"}])
@pytest.mark.parametrize("schema, why", [
    ({"type": "object", "properties": {"city": {"type": "strin"}}}, "input_schema.properties.city.type"),
    ({"type": "object", "properties": [], "required": ["city"]}, "input_schema.properties"),
    ({"type": "object", "required": "city"}, "input_schema.required"),
    ({"type": "array", "items": {"type": "string"}}, "must have type 'object'"),
    ({"properties": {"city": {"type": "string"}}}, "must have type 'object'"),
])
def test_a_bad_input_schema_is_refused_naming_its_tool_under_every_tool_choice(client, choice, schema, why):
    tool = {**WEATHER, "input_schema": schema}
    kw = {"tool_choice": choice} if choice is not None else {}
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=[ASK], tools=[tool], **kw)
    message = e.value.body["error"]["message"]
    assert "'get_weather'" in message and why in message and message.startswith("tools.0.input_schema")
    assert "<tool_call>" not in message and "%json" not in message and "lark" not in message.lower()
