"""What clients send is honoured or refused: structured output, tools, logit_bias, long prompts (real SDKs)."""
import json
import re

import httpx
import jsonschema
import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import HfHubHTTPError

MODEL = "smollm2-135m-instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def client(fast_server):
    return openai.OpenAI(base_url=fast_server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, content, **kw):
    kw.setdefault("max_tokens", 96)
    return client.chat.completions.create(model=MODEL, temperature=0, messages=[{"role": "user", "content": content}], **kw)


PROMPTS = [
    "Describe a cat as JSON.", "Give me a JSON list of three fruits with colors.", "JSON for a book: title, year.",
    "Give a JSON object with a fruit's name and colour.", "Return JSON with keys city and country for Paris.",
    "A JSON object with a number field x set to 3.", "Return a JSON object describing a red car.",
    "Write a JSON recipe for pancakes with ingredients and steps.",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_json_object_output_parses_within_max_tokens(client, prompt):
    """The issue's prompts ran to max_tokens mid-string; a reply near its limit now closes its JSON in time."""
    for max_tokens in (120, 24):
        r = ask(client, prompt, response_format={"type": "json_object"}, max_tokens=max_tokens)
        assert isinstance(json.loads(r.choices[0].message.content), dict), (max_tokens, r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= max_tokens


SHAPES = {
    "cat": {"type": "object", "properties": {"name": {"type": "string"}, "color": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "color", "age"]},
    "fruits": {"type": "object", "properties": {"fruits": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}, "color": {"type": "string"}}, "required": ["name", "color"]}}},
        "required": ["fruits"]},
    "recipe": {"type": "object", "properties": {"ingredients": {"type": "array", "items": {"type": "string"}},
                                                "steps": {"type": "array", "items": {"type": "string"}}},
               "required": ["ingredients", "steps"]},
}


@pytest.mark.parametrize("name", SHAPES)
def test_json_schema_output_matches_within_max_tokens(client, name):
    schema = SHAPES[name]
    for max_tokens in (120, 40):
        r = ask(client, f"Give me a {name} as JSON.", max_tokens=max_tokens,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
        assert r.choices[0].finish_reason == "stop"


PERSON = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "address": {"type": "object", "additionalProperties": False,
                    "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
}


@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_output_validates(client, strict):
    r = ask(client, "Make up a user of a web site.", max_tokens=160,
            response_format={"type": "json_schema", "json_schema": {"name": "user", "schema": PERSON, "strict": strict}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_regex_grammar_and_choice_extensions(client):
    r = ask(client, "Give a date.", extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", r.choices[0].message.content)
    r = ask(client, "Is the sky blue?", extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = ask(client, "Count.", extra_body={"guided_grammar": 'root ::= "one, " "two" ("!" | "?")'})  # GBNF
    assert r.choices[0].message.content in ("one, two!", "one, two?")
    c = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=8, temperature=0,
                                  extra_body={"grammar": 'start: " " NUMBER\nNUMBER: /[0-9]{1,3}/'})  # Lark
    assert re.fullmatch(r" [0-9]{1,3}", c.choices[0].text)


def test_malformed_constraints_get_a_400_naming_the_problem(client):
    with pytest.raises(openai.BadRequestError, match="objekt"):
        ask(client, "x", response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "objekt"}}})
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        ask(client, "x", extra_body={"guided_regex": "[0-9]+("})
    with pytest.raises(openai.BadRequestError, match="only one output constraint"):
        ask(client, "x", response_format={"type": "json_object"}, extra_body={"guided_regex": "a"})


RECURSIVE = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}},
             "$ref": "#/$defs/node"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("constraint, why", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": RECURSIVE}}}, "no output can complete it"),
    ({"extra_body": {"guided_grammar": 'start: "a" start'}}, "no output can complete it"),
    ({"extra_body": {"guided_grammar": 'start: ("a" | "c") start'}}, "can never end"),
    ({"extra_body": {"guided_grammar": 'root ::= "x" item\nitem ::= [a-z] item'}}, "can never end"),  # GBNF
    ({"extra_body": {"guided_regex": "a{3}b{0}[^\\s\\S]"}}, "no output can match it"),
])
def test_a_constraint_no_output_can_satisfy_gets_a_400(client, constraint, why, stream):
    with pytest.raises(openai.BadRequestError, match=why):
        ask(client, "Hi", stream=stream, **constraint)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_gives_calls_whose_arguments_validate(client, stream):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    if not stream:
        r = ask(client, "What is the weather in Paris?", **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        deltas, reason = {}, None
        for chunk in ask(client, "What is the weather in Paris?", stream=True, **kw):
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = deltas.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            assert not chunk.choices[0].delta.content
            reason = chunk.choices[0].finish_reason or reason
        assert reason == "tool_calls"
        calls = [(d["id"], d["name"], d["arguments"]) for d in deltas.values()]
    assert len(calls) == 1
    call_id, name, arguments = calls[0]
    assert call_id.startswith("call_") and name in ("get_weather", "get_time")
    tool = WEATHER if name == "get_weather" else TIME
    jsonschema.validate(json.loads(arguments), tool["function"]["parameters"])


def test_a_streamed_tool_call_comes_as_argument_deltas_the_sdk_rebuilds(client):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    argument_deltas = 0
    with client.chat.completions.stream(model=MODEL, temperature=0, messages=[
            {"role": "user", "content": "What is the weather in Paris?"}], **kw) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                argument_deltas += 1
        final = stream.get_final_completion()
    # the arguments arrive while they are generated, not as one chunk at the end
    assert argument_deltas >= 3, argument_deltas
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    tool = WEATHER if call.function.name == "get_weather" else TIME
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_too_long_for_max_tokens_is_refused_before_it_runs(client, stream):
    """No call fits 15 tokens: a 400 naming the tokens the shortest takes, not a reply cut to nothing."""
    with pytest.raises(openai.BadRequestError, match=r"shortest form takes (\d+) tokens") as refused:
        ask(client, "What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice="required", max_tokens=15,
            stream=stream)
    needed = int(re.search(r"takes (\d+) tokens", str(refused.value)).group(1))
    r = ask(client, "What is the weather in Paris?", tools=[WEATHER, TIME], tool_choice="required", max_tokens=needed,
            parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1  # and it fits


CITY = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


def compact_tokens(server, calls) -> int:
    """The tokens of the calls written as compactly as the format allows."""
    text = "\n".join("<tool_call>\n" + json.dumps({"name": c.function.name, "arguments": json.loads(c.function.arguments)})
                     + "\n</tool_call>" for c in calls)
    return httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text,
                                                      "add_special_tokens": False}).json()["count"]


@pytest.mark.parametrize("max_tokens", [80, 40])
def test_a_forced_call_costs_about_its_compact_text(client, fast_server, max_tokens):
    """One call, written as compactly as its format allows: no free whitespace."""
    r = ask(client, "What is the weather in Paris?", tools=[CITY], tool_choice="required", max_tokens=max_tokens,
            parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    assert r.usage.completion_tokens <= 1.3 * compact_tokens(fast_server, calls), r.usage


def test_parallel_forced_calls_never_return_a_call_twice(client, fast_server):
    """With parallel calls, a call the model says again ends the reply before it (SmolLM2 repeats its one
    call): the reply keeps one, and the tokens spent are at most the two copies."""
    r = ask(client, "What is the weather in Paris?", tools=[CITY], tool_choice="required", max_tokens=80)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert len({(c.function.name, c.function.arguments) for c in calls}) == len(calls) >= 1
    assert r.usage.completion_tokens <= 1.3 * compact_tokens(fast_server, calls * 2), r.usage


def test_parallel_calls_near_max_tokens_close_the_last_call_in_time(client):
    """The model repeats its call until the limit; the last one is closed within max_tokens, not cut."""
    r = ask(client, "What is the weather in Paris, London, Rome and Oslo?", tools=[WEATHER], tool_choice="required",
            max_tokens=100)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    assert len(choice.message.tool_calls) >= 2 and r.usage.completion_tokens <= 100
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_named_tool_choice_calls_that_function(client):
    r = ask(client, "Hello!", tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False, max_tokens=80)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time"]
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), TIME["function"]["parameters"])
    with pytest.raises(openai.BadRequestError, match="get_date"):
        ask(client, "x", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_date"}})


# what pydantic writes for a nested model: the inner model under $defs, reached by $ref
ORDER = {"type": "function", "function": {"name": "place_order", "parameters": {
    "$defs": {"Item": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                                        "count": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["name", "count"], "additionalProperties": False}},
    "type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "place_order"}}],
                         ids=["required", "named"])
def test_a_forced_call_with_defs_and_refs_validates(client, choice):
    r = ask(client, "Order two apples.", tools=[ORDER, TIME], tool_choice=choice, parallel_tool_calls=False, max_tokens=80)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and (choice == "required" or calls[0].function.name == "place_order")
    schema = {"place_order": ORDER, "get_time": TIME}[calls[0].function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_a_named_function_is_called_once_even_with_parallel_calls_allowed(client):
    r = ask(client, "What is the weather in Paris, London, Rome and Oslo?", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=200)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    assert r.usage.completion_tokens < 100


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_call_ends_without_a_cap_and_never_repeats_itself(client, stream):
    """Left alone, the model repeats the same call until the context is full; a repeat ends the reply."""
    r = client.chat.completions.create(model=MODEL, temperature=0, tools=[WEATHER], tool_choice="required",
                                       messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                       stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(r)
        calls: dict[int, list[str]] = {}
        for c in chunks:
            for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
                calls.setdefault(d.index, []).append(d.function.arguments or "")
        arguments = ["".join(parts) for parts in calls.values()]
        reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        used = chunks[-1].usage.completion_tokens
    else:
        arguments = [c.function.arguments for c in r.choices[0].message.tool_calls]
        reason, used = r.choices[0].finish_reason, r.usage.completion_tokens
    assert reason == "tool_calls" and arguments and used < 100
    assert len(set(arguments)) == len(arguments)  # no call twice


def test_anthropic_any_ends_without_repeating_a_call(fast_server):
    import anthropic

    tool = {"name": "get_weather", "description": "The current weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    ac = anthropic.Anthropic(base_url=fast_server.url, api_key="unused", max_retries=0)
    m = ac.messages.create(model=MODEL, max_tokens=1000, extra_body={"temperature": 0}, tools=[tool],
                           tool_choice={"type": "any"}, messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    uses = [json.dumps(b.input, sort_keys=True) for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and uses and len(set(uses)) == len(uses) and m.usage.output_tokens < 100


def test_a_tool_result_round_trip(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, temperature=0, messages=messages, tools=[WEATHER],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    final = client.chat.completions.create(model=MODEL, temperature=0, messages=messages, tools=[WEATHER], max_tokens=40)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    assert final.choices[0].finish_reason in ("stop", "length")
    # the call and its result went into the prompt
    assert final.usage.prompt_tokens > first.usage.prompt_tokens + len(call.function.arguments) // 4 + 10


def test_logit_bias_bans_and_forces_tokens(client, fast_server):
    tok = fast_server.engine.tokenizer
    plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    banned = tok.encode(first, add_special=False)
    assert len(banned) == 1
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0, logprobs=0,
                                  logit_bias={str(banned[0]): -100})
    assert first not in r.choices[0].logprobs.tokens
    forced = tok.encode(" banana", add_special=False)[0]
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0.8,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].text == " banana" * 3
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"999999": 5})


def test_fields_that_would_change_the_output_are_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, best_of=2)
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        ask(client, "x", extra_body={"frobnicate": True})
    with pytest.raises(HfHubHTTPError, match="typical_p"):
        InferenceClient(str(client.base_url).replace("/v1/", "")).text_generation("x", max_new_tokens=1, typical_p=0.5)
    # fields that only annotate are accepted
    r = ask(client, "Hi", max_tokens=2, user="u-1", metadata={"team": "a"}, store=False, service_tier="auto")
    assert r.choices[0].finish_reason == "length"


def test_tgi_grammar_through_huggingface_hub(fast_server):
    hf = InferenceClient(fast_server.url)
    out = hf.text_generation("The year the moon landing happened:", max_new_tokens=8,
                             grammar={"type": "regex", "value": " 19[0-9]{2}"})
    assert re.fullmatch(r" 19[0-9]{2}", out)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    out = hf.text_generation("A city as JSON:", max_new_tokens=40, grammar={"type": "json", "value": schema})
    jsonschema.validate(json.loads(out), schema)


@pytest.mark.slow  # a 6,000-token prefill
def test_a_6000_token_prompt_succeeds_on_default_flags(client):
    text = " ".join(["the river runs past the old mill and the stone bridge"] * 560)
    r = client.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens >= 6000 and r.choices[0].finish_reason == "length"


def test_a_call_after_text_streams_as_a_call_not_as_content():
    """In `auto`, the model may write a sentence before its call: the markup never streams as content."""
    from server.api.tool_stream import ToolCallStream

    stream = ToolCallStream({"get_time"}, forced=False)
    pieces = ["Let me ", "check.\n<", "tool_", 'call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n</tool_call>\n']
    content, deltas = "", []
    for piece in pieces:
        text, ds = stream.feed(piece)
        content, deltas = content + text, deltas + ds
    text, ds = stream.finish()
    content, deltas = content + text, deltas + ds
    assert content == "Let me check.\n" and stream.complete == 1
    assert deltas[0]["function"]["name"] == "get_time"
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Oslo"}
    # a "<" that begins no tag is content, once the text shows it
    plain = ToolCallStream({"get_time"}, forced=False)
    assert plain.feed("a < b <")[0] == "a < b " and plain.finish()[0] == "<"
