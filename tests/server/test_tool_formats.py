"""Tool calls in the format of the model's chat template: Llama 3's JSON and Mistral's [TOOL_CALLS], read
by every dialect as calls (never as content), whole and streamed, and earlier calls written back into the
chat in that format. SmolLM2 runs under the real templates (chat_templates.py); guided decoding (OpenAI's
regex, Anthropic's and the Responses API's JSON schemas) makes its reply a call."""
import json

import anthropic
import httpx
import ollama
import pytest

from server.api import tool_formats

from ..live_server import LiveServer
from ..models.gguf_files import llama_cpp_source
from .chat_templates import LLAMA3, MISTRAL, QWEN3, exactly, oai, with_template

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARIS = {"city": "Paris"}


@pytest.fixture(scope="module")
def llama3(smollm):
    with LiveServer(with_template(smollm, LLAMA3)) as server:
        yield server


@pytest.fixture(scope="module")
def mistral(smollm):
    with LiveServer(with_template(smollm, MISTRAL)) as server:
        yield server




def reply(server, text: str, stream: bool = False):
    """The chat reply made exactly `text`: the whole message, or the streamed deltas put together."""
    r = oai(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=80,
                                            stream=stream, extra_body={"guided_regex": exactly(text)})
    if not stream:
        return r.choices[0].message.content, [(c.function.name, json.loads(c.function.arguments))
                                              for c in r.choices[0].message.tool_calls or []], r.choices[0].finish_reason
    content, calls, reason = "", {}, None
    for chunk in r:
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason or reason
        content += delta.content or ""
        for d in delta.tool_calls or []:
            name, arguments = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.function.name or ""), arguments + (d.function.arguments or ""))
    return content or None, [(n, json.loads(a)) for n, a in calls.values()], reason


def test_the_format_is_picked_from_the_template(smollm):
    picked = {name: tool_formats.format_for(t).name
              for name, t in [("qwen3", QWEN3), ("llama3", LLAMA3), ("mistral", MISTRAL),
                              ("smollm2", smollm.tokenizer.meta.chat_template), ("none", None)]}
    assert picked == {"qwen3": "hermes", "llama3": "llama3_json", "mistral": "mistral", "smollm2": "hermes",
                      "none": "hermes"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text", ['{"name": "get_weather", "parameters": {"city": "Paris"}}',
                                  '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}'])
def test_llama3_json_is_a_call(llama3, text, stream):
    assert reply(llama3, text, stream) == (None, [("get_weather", PARIS)], "tool_calls")


@pytest.mark.parametrize("stream", [False, True])
def test_llama3_json_that_is_no_call_is_content(llama3, stream):
    for text in ('{"name": "get_time", "parameters": {}}', 'It is {"name": "get_weather"}', '{"answer": 42}'):
        assert reply(llama3, text, stream) == (text, [], "stop")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text, content, cities", [
    ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, ["Paris"]),
    ('Let me look. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Let me look.", ["Paris", "Rome"]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', None,
     ["Paris", "Rome"]),
])
def test_mistral_tool_calls(mistral, text, content, cities, stream):
    got_content, calls, reason = reply(mistral, text, stream)
    assert (got_content or None) in (content, content and content + " ")  # streamed text may keep the space
    assert calls == [("get_weather", {"city": c}) for c in cities] and reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_mistral_call_cut_short_is_dropped_not_shown(mistral, stream):
    """max_tokens ends the reply inside the call's JSON (the marker, one token in Mistral's vocabulary, is
    eight in SmolLM2's)."""
    r = oai(mistral).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=14, stream=stream,
        extra_body={"guided_regex": exactly('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')})
    if stream:
        chunks = [c.choices[0] for c in r]
        content, reason = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
        assert not any(c.delta.tool_calls for c in chunks)
    else:
        content, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert r.choices[0].message.tool_calls is None
    assert reason == "length" and content.strip() == "Sure."


def call_schema(call: dict) -> dict:
    """A JSON schema that only `call` matches (it fixes every value)."""
    return {"type": "object", "properties": {k: {"const": v} for k, v in call.items()}, "required": list(call),
            "additionalProperties": False}


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_reads_a_llama3_call_as_tool_use(llama3, stream):
    client = anthropic.Anthropic(base_url=llama3.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, messages=ASK, max_tokens=60, extra_body={"temperature": 0},
              tools=[{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}],
              output_config={"format": {"type": "json_schema",
                                        "schema": call_schema({"name": "get_weather", "parameters": PARIS})}})
    if stream:
        with client.messages.stream(**kw) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            message = s.get_final_message()
        assert "text_delta" not in deltas
    else:
        message = client.messages.create(**kw)
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", "get_weather", PARIS)]
    assert message.stop_reason == "tool_use"


def test_responses_read_a_llama3_call_as_a_function_call(llama3):
    client = oai(llama3)
    fmt = {"type": "json_schema", "name": "call", "schema": call_schema({"name": "get_weather", "parameters": PARIS})}
    kw = dict(model=MODEL, input=ASK[0]["content"], temperature=0, max_output_tokens=60, text={"format": fmt},
              tools=[{"type": "function", **WEATHER["function"]}])
    r = client.responses.create(**kw)
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == [("function_call", "get_weather", PARIS)]
    with client.responses.stream(**kw) as s:
        final = s.get_final_response()
    assert [(i.type, i.name, json.loads(i.arguments)) for i in final.output] == [("function_call", "get_weather", PARIS)]


def rendered(server, messages: list[dict]) -> str:
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
    return server.engine.tokenizer.decode(ids, skip_special=False)


def test_earlier_calls_go_back_in_the_templates_own_format(llama3, mistral):
    call = {"id": "call_abc123def456", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "20C"}]
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in rendered(llama3, turn)
    # Mistral's template wants 9-character ids: the call and its result get the same one
    text = rendered(mistral, turn)
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "' in text
    first = text.index('"id": "') + 7
    assert f'"call_id": "{text[first:first + 9]}"' in text and "[AVAILABLE_TOOLS]" in text
    # Ollama's messages name no call ids: a tool result answers the call before it
    client = ollama.Client(host=mistral.url)
    history = [*ASK, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                       "arguments": PARIS}}]},
               {"role": "tool", "content": "20C", "tool_name": "get_weather"}]
    assert client.chat(model=MODEL, messages=history, tools=[WEATHER], options={"num_predict": 1}).done


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fixture, opening", [("llama3", '{"name": "get_weather", "parameters": {"city": "'),
                                              ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "')])
def test_a_forced_call_is_written_in_the_templates_own_format(request, fixture, opening, stream):
    """tool_choice "required": the grammar has the model write its call as its template writes calls (the
    reply's tokens say so), and the reply reads it back as the structured call."""
    server = request.getfixturevalue(fixture)
    r = oai(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=60,
                                            tool_choice="required", logprobs=True, stream=stream)
    if stream:
        chunks = [c.choices[0] for c in r]
        tokens = [t.token for c in chunks if c.logprobs for t in c.logprobs.content]
        calls = [d for c in chunks for d in c.delta.tool_calls or []]
        names = [d.function.name for d in calls if d.function.name]
        reason = chunks[-1].finish_reason
    else:
        tokens = [t.token for t in r.choices[0].logprobs.content]
        names = [c.function.name for c in r.choices[0].message.tool_calls]
        reason = r.choices[0].finish_reason
    assert "".join(tokens).startswith(opening), tokens
    assert names and set(names) == {"get_weather"} and reason == "tool_calls"


def test_lfm2_pythonic_calls_are_read_and_cut_ones_dropped():
    """LFM2's `<|tool_call_start|>[f(a='x', n=3)]<|tool_call_end|>`: keyword arguments as Python literals."""
    from server.api.tool_formats import pythonic

    names = {"get_weather": {}, "get_time": {}}
    content, calls = pythonic.parse("Let me look. <|tool_call_start|>[get_weather(city='Paris', days=3, hourly=True), "
                                    "get_time(zone={\"tz\": \"CET\"})]<|tool_call_end|>", names)
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3, "hourly": True}), ("get_time", {"zone": {"tz": "CET"}})]
    assert pythonic.parse("<|tool_call_start|>[get_weather(city='Par", names) == (None, [])  # cut short: dropped
    assert pythonic.parse("<|tool_call_start|>[os.system('x'), nope(a=1)]<|tool_call_end|>", names) == (None, [])
    assert pythonic.parse("No call here.", names) == ("No call here.", [])
    lfm = llama_cpp_source() / "models" / "templates"
    assert {tool_formats.format_for((lfm / f"{t}.jinja").read_text()).name
            for t in ("LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct")} == {"pythonic"}
