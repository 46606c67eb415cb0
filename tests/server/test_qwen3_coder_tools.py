"""Qwen3-Coder's tool calls: XML blocks whose parameters are typed by the tool's schema, read as structured
calls by every dialect, whole and streamed, and earlier calls written back as its template (Qwen3-Coder's
own, tests/server/templates/) takes them, the prompt then the one transformers renders.

A tiny random Qwen3-MoE checkpoint with that template serves what guided decoding makes it write; SmolLM2
under the template copies the calls of a few earlier turns, so that the dialects without a regex constraint
(Responses, Anthropic, Ollama) get an XML call too."""
import json

import anthropic
import httpx
import ollama
import pytest

from models import load_model
from server.api import tool_formats
from server.api.tool_formats import qwen3_coder

from ..live_server import LiveServer
from ..models.test_moe import write_moe_checkpoint
from .chat_templates import QWEN3, TEMPLATES, exactly, oai, with_template

MODEL = "smollm2-135m-instruct"
TEMPLATE = (TEMPLATES / "qwen3_coder.jinja").read_text()
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                           "hourly": {"type": "boolean"}, "near": {"type": "object"}},
          "required": ["city", "days"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city over some days", "parameters": SCHEMA}}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=hourly>\ntrue\n</parameter>\n"
        "<parameter=near>\n{\"lat\": 48.9}\n</parameter>\n</function>\n</tool_call>")
TYPED = {"city": "Paris", "days": 3, "hourly": True, "near": {"lat": 48.9}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# earlier turns whose calls SmolLM2 copies for Paris: (city, days, the tool's result)
SHOTS = [("London", 2, "15 C, cloudy"), ("Berlin", 3, "20 C, sunny"), ("Madrid", 5, "30 C, sunny")]
PARIS = ("get_weather", {"city": "Paris", "days": 4})


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, smollm):
    tokenizer = with_template(smollm, TEMPLATE).tokenizer  # the checkpoint's tokenizer_config holds the template
    return write_moe_checkpoint(tmp_path_factory.mktemp("qwen3coder"), "qwen3moe", tokenizer)


@pytest.fixture(scope="module")
def moe(moe_folder):
    with LiveServer(load_model(str(moe_folder), weights="f32", use_cache=False)) as server:
        yield server


@pytest.fixture(scope="module")
def fewshot(smollm):
    with LiveServer(with_template(smollm, TEMPLATE)) as server:
        yield server


def test_the_format_is_picked_from_the_template():
    assert tool_formats.format_for(TEMPLATE).name == "qwen3_coder"
    assert tool_formats.format_for(QWEN3).name == "hermes"  # Qwen3's own, with <tool_call> but JSON calls


@pytest.mark.parametrize("text, content, calls", [
    ("Let me look.\n\n" + CALL, "Let me look.", [TYPED]),
    (CALL + "\n" + CALL.replace("Paris", "Rome"), None, [TYPED, {**TYPED, "city": "Rome"}]),
    # no <tool_call>, a parameter left open, Python's True, a number where the schema wants an integer
    ("<function=get_weather><parameter=days>4.0<parameter=hourly>True</function>", None, [{"days": 4, "hourly": True}]),
    # values the schema's type does not fit stay text; an unknown parameter is text
    ("<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=x>\n1\n</parameter>\n</function>", None,
     [{"days": "three", "x": "1"}]),
    ("Sure. " + CALL[:60], "Sure.", []),  # a call cut short is dropped, never shown
    # markup that makes no call of an offered function is content: a call of another, prose about the format
    *[(text, text, []) for text in ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                                     "Wrap it in <tool_call> and </tool_call>.")],
])
def test_a_reply_reads_whole_and_streamed_alike(text, content, calls):
    functions = {"get_weather": SCHEMA}
    got_content, got = qwen3_coder.parse(text, functions)
    assert (got_content, [json.loads(c["function"]["arguments"]) for c in got]) == (content, calls)
    for size in (1, 3, 7):  # every cut of the text into pieces of this size
        stream, streamed, deltas = qwen3_coder.FORMAT.stream(functions), "", []
        for at in range(0, len(text), size):
            piece, more = stream.feed(text[at:at + size])
            streamed, deltas = streamed + piece, deltas + more
        piece, more = stream.finish()
        assert (streamed + piece, [json.loads(d["function"]["arguments"]) for d in deltas + more]) == \
               (got_content or "", calls)


def test_the_prompt_is_the_one_transformers_renders(moe, moe_folder):
    """An earlier call's arguments, JSON text in OpenAI's shape, reach the template as an object: it writes
    each parameter itself (a number as text, an object as JSON)."""
    import transformers

    arguments = {"city": "Paris", "days": 3, "near": {"lat": 48.9}}
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
    turn = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C"}, {"role": "user", "content": "And Rome?"}]
    ours = httpx.post(moe.url + "/tokenize", json={"messages": turn, "tools": [WEATHER]}).json()["tokens"]
    as_object = {**call, "function": {**call["function"], "arguments": arguments}}  # transformers' convention
    hf_turn = [*turn[:2], {**turn[2], "tool_calls": [as_object]}, *turn[3:]]
    hf = transformers.AutoTokenizer.from_pretrained(moe_folder)
    text = hf.apply_chat_template(hf_turn, tools=[WEATHER], tokenize=False, add_generation_prompt=True)
    assert "<parameter=days>\n3\n</parameter>\n<parameter=near>\n{\"lat\": 48.9}\n</parameter>" in text
    assert moe.engine.tokenizer.decode(ours, skip_special=False) == text
    assert ours == hf(text, add_special_tokens=False)["input_ids"]


def chat(server, text: str, stream: bool, max_tokens: int = 100):
    """The chat reply made exactly `text` -> (content, [(name, arguments)], finish reason), streamed or not."""
    r = oai(server).chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, stream=stream,
                                            max_tokens=max_tokens, extra_body={"guided_regex": exactly(text)})
    if not stream:
        m = r.choices[0].message
        return m.content, [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []], \
            r.choices[0].finish_reason
    content, calls, reason = "", {}, None
    for chunk in r:
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason or reason
        content += delta.content or ""
        for d in delta.tool_calls or []:
            name, arguments = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.function.name or ""), arguments + (d.function.arguments or ""))
    return content or None, [(n, json.loads(a)) for n, a in calls.values()], reason


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_reads_a_typed_call_from_qwen3_moe(moe, stream):
    assert chat(moe, "Let me look.\n" + CALL, stream) == ("Let me look.", [("get_weather", TYPED)], "tool_calls")
    # cut short by max_tokens: the call is dropped, never shown
    content, calls, reason = chat(moe, "Let me look.\n" + CALL, stream, max_tokens=12)
    assert (content, calls, reason) == ("Let me look.", [], "length")


def openai_history() -> list[dict]:
    out = []
    for i, (city, days, result) in enumerate(SHOTS):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "days": days})}}
        out += [{"role": "user", "content": f"What is the weather in {city} for {days} days?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"call_{i}", "content": result}]
    return [*out, {"role": "user", "content": "What is the weather in Paris for 4 days?"}]


@pytest.fixture(scope="module")
def fewshot_prompt(fewshot) -> int:
    """The prompt's length, once SmolLM2 is seen to write the XML call after it: a dialect whose prompt is
    as long (the same conversation, rendered alike) gets that reply, so it read the call from XML."""
    body = {"messages": openai_history(), "tools": [WEATHER]}
    ids = httpx.post(fewshot.url + "/tokenize", json=body).json()["tokens"]
    text = oai(fewshot).completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=60).choices[0].text
    assert text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"), text
    return len(ids)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_read_the_call_as_a_function_call(fewshot, fewshot_prompt, stream):
    items = []
    for m in openai_history():
        if m["role"] == "user":
            items.append({"type": "message", "role": "user", "content": m["content"]})
        elif m["role"] == "assistant":
            f = m["tool_calls"][0]
            items.append({"type": "function_call", "call_id": f["id"], **f["function"]})
        else:
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
    kw = dict(model=MODEL, input=items, temperature=0, max_output_tokens=60,
              tools=[{"type": "function", **WEATHER["function"]}])
    if stream:
        with oai(fewshot).responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = oai(fewshot).responses.create(**kw)
    assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output] == [("function_call", *PARIS)]
    assert r.usage.input_tokens == fewshot_prompt


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_reads_the_call_as_tool_use(fewshot, fewshot_prompt, stream):
    messages, results = [], []
    for m in openai_history():
        if m["role"] == "user":
            messages.append({"role": "user", "content": [*results, {"type": "text", "text": m["content"]}]})
            results = []
        elif m["role"] == "assistant":
            f = m["tool_calls"][0]
            messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": f["id"], "name": "get_weather",
                                                               "input": json.loads(f["function"]["arguments"])}]})
        else:
            results = [{"type": "tool_result", "tool_use_id": m["tool_call_id"], "content": m["content"]}]
    client = anthropic.Anthropic(base_url=fewshot.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, messages=messages, max_tokens=60, extra_body={"temperature": 0},
              tools=[{"name": "get_weather", "description": WEATHER["function"]["description"],
                      "input_schema": SCHEMA}])
    if stream:
        with client.messages.stream(**kw) as s:
            deltas = [e.delta.type for e in s if e.type == "content_block_delta"]
            message = s.get_final_message()
        assert "text_delta" not in deltas  # the markup is never text
    else:
        message = client.messages.create(**kw)
    assert [(b.type, b.name, b.input) for b in message.content] == [("tool_use", *PARIS)]
    assert message.stop_reason == "tool_use"
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == fewshot_prompt


@pytest.mark.parametrize("stream", [False, True])
def test_ollama_reads_the_call_as_tool_calls(fewshot, fewshot_prompt, stream):
    messages = []
    for m in openai_history():
        if m["role"] == "assistant":
            f = m["tool_calls"][0]["function"]
            call = {"function": {"name": f["name"], "arguments": json.loads(f["arguments"])}}
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif m["role"] == "tool":
            messages.append({"role": "tool", "content": m["content"], "tool_name": "get_weather"})
        else:
            messages.append(m)
    out = ollama.Client(host=fewshot.url).chat(model=MODEL, messages=messages, tools=[WEATHER], stream=stream,
                                               options={"temperature": 0, "num_predict": 60})
    parts = list(out) if stream else [out]
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [PARIS]
    assert "<function=" not in "".join(p.message.content or "" for p in parts)
    assert parts[-1].done and parts[-1].prompt_eval_count == fewshot_prompt


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_written_as_the_template_writes_it(fewshot, stream):
    """tool_choice "required": the XML call, its parameters typed by the schema (the integer as JSON, the
    string as text), read back as the typed call."""
    r = oai(fewshot).chat.completions.create(model=MODEL, messages=openai_history(), tools=[WEATHER], temperature=0,
                                             tool_choice="required", max_tokens=80, logprobs=True, stream=stream)
    if stream:
        chunks = [c.choices[0] for c in r]
        tokens = [t.token for c in chunks if c.logprobs for t in c.logprobs.content]
        calls = {}
        for d in (d for c in chunks for d in c.delta.tool_calls or []):
            name, arguments = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.function.name or ""), arguments + (d.function.arguments or ""))
        calls, reason = list(calls.values()), chunks[-1].finish_reason
    else:
        tokens = [t.token for t in r.choices[0].logprobs.content]
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        reason = r.choices[0].finish_reason
    assert "".join(tokens).startswith("<tool_call>\n<function=get_weather>\n<parameter=city>\n"), tokens
    name, arguments = calls[0]
    arguments = json.loads(arguments)
    assert name == "get_weather" and reason == "tool_calls"
    assert isinstance(arguments["city"], str) and isinstance(arguments["days"], int), arguments
