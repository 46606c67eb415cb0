"""Thinking models: a reply's think block comes back apart from its content in every dialect, through each
one's own SDK, and each dialect's switch for thinking reaches the chat template (Qwen3's enable_thinking).

SmolLM2 runs under Qwen3's real chat template. Where the dialect has guided decoding (OpenAI's chat), the
reply is made exactly `<think>...</think>...`; elsewhere the template opens the think block itself (as
Qwen3.5's and DeepSeek-R1's do) and the prompt shows the model a reply to copy, which greedy decoding does:
its text is checked against the OpenAI route's reading of the same reply first.
"""
import json

import anthropic
import httpx
import ollama
import openai
import pytest

from ..live_server import LiveServer
from .chat_templates import QWEN3, QWEN3_OPENING, exactly, oai, with_template

MODEL = "smollm2-135m-instruct"
THOUGHT = "<think>\nabc\n</think>\n\nHello"
HI = [{"role": "user", "content": "Hi"}]
# shown three times, the model copies it: under a template that opened the think block, a thought and a reply
COPY = [{"role": "user", "content": "\n\n".join(["The sky is blue.\n</think>\n\nHello there."] * 3)}]
END = "\n\nThe sky"  # where the copied reply starts over


@pytest.fixture(scope="module")
def qwen3(smollm):
    with LiveServer(with_template(smollm, QWEN3)) as server:
        yield server


@pytest.fixture(scope="module")
def opening(smollm):
    with LiveServer(with_template(smollm, QWEN3_OPENING)) as server:
        yield server




def forced(server, text: str, **kw):
    kw.setdefault("max_tokens", 40)
    return oai(server).chat.completions.create(model=MODEL, messages=HI, temperature=0,
                                               extra_body={"guided_regex": exactly(text)}, **kw)


def test_openai_chat_gives_the_think_block_as_reasoning_content(qwen3):
    r = forced(qwen3, THOUGHT)
    message = r.choices[0].message
    assert (message.reasoning_content, message.content, r.choices[0].finish_reason) == ("abc", "Hello", "stop")
    deltas = [c.choices[0].delta for c in forced(qwen3, THOUGHT, stream=True) if c.choices]
    thought = "".join(d.reasoning_content or "" for d in deltas if hasattr(d, "reasoning_content"))
    content = "".join(d.content or "" for d in deltas)
    assert (thought, content) == ("abc", "Hello")
    assert not any("think>" in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)


def test_a_think_block_never_closed_is_all_reasoning(qwen3):
    r = forced(qwen3, "<think>\nabc abc abc abc abc abc abc abc abc abc", max_tokens=6)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and message.content is None
    assert message.reasoning_content.startswith("abc abc") and "<think>" not in message.reasoning_content
    deltas = [c.choices[0].delta for c in forced(qwen3, "<think>\nabc abc abc abc abc abc abc", max_tokens=6, stream=True)
              if c.choices]
    assert not any(d.content for d in deltas) and "".join(d.reasoning_content or "" for d in deltas
                                                          if hasattr(d, "reasoning_content")).startswith("abc abc")


def test_a_reply_without_a_think_block_is_all_content(qwen3):
    message = forced(qwen3, "Hello <think>x</think>").choices[0].message
    assert message.reasoning_content is None and message.content == "Hello <think>x</think>"


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_then_a_call(qwen3, stream):
    """Qwen3 thinks, then calls in the Hermes format: the thought is reasoning, the call a tool call."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    r = forced(qwen3, "<think>\nI will look it up.\n</think>\n\n" + call, tools=[weather], stream=stream, max_tokens=60)
    if stream:
        chunks = [c.choices[0] for c in r]
        thought = "".join(getattr(c.delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.delta.content or "" for c in chunks)
        calls = [d.function for c in chunks for d in c.delta.tool_calls or []]
        name, arguments, reason = calls[0].name, "".join(f.arguments or "" for f in calls), chunks[-1].finish_reason
    else:
        message, reason = r.choices[0].message, r.choices[0].finish_reason
        thought, content = message.reasoning_content, message.content or ""
        name, arguments = message.tool_calls[0].function.name, message.tool_calls[0].function.arguments
    assert (thought, content, name, reason) == ("I will look it up.", "", "get_weather", "tool_calls")
    assert json.loads(arguments) == {"city": "Paris"}


def test_enable_thinking_false_reaches_the_template(qwen3, smollm):
    def count(**kw):
        return httpx.post(qwen3.url + "/tokenize", json={"messages": HI, **kw}).json()["count"]

    closed = len(smollm.tokenizer.encode("<think>\n\n</think>\n\n", add_special=False))
    assert count(chat_template_kwargs={"enable_thinking": False}) == count() + closed
    assert count(chat_template_kwargs={"enable_thinking": True}) == count()
    client = oai(qwen3)
    on = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    off = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + closed
    for taken in ("messages", "namespace"):  # the server's own variables, and Jinja's
        with pytest.raises(openai.BadRequestError, match=f"may not set '{taken}'"):
            client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                           extra_body={"chat_template_kwargs": {taken: []}})


def test_an_earlier_replys_reasoning_goes_back_into_the_template(qwen3):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = [*HI, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "20C"}]
    plain = httpx.post(qwen3.url + "/tokenize", json={"messages": turn}).json()["count"]
    turn[1]["reasoning_content"] = "I should look it up."
    assert httpx.post(qwen3.url + "/tokenize", json={"messages": turn}).json()["count"] > plain + 4


def reference(server, **kw) -> tuple[str, str]:
    """How the OpenAI route reads the copied reply (its reasoning, its content): the premise of the tests below."""
    m = oai(server).chat.completions.create(model=MODEL, messages=COPY, temperature=0, **kw).choices[0].message
    assert m.reasoning_content == "The sky is blue." and m.content.startswith("Hello there."), m
    return m.reasoning_content, m.content


def test_anthropic_gives_thinking_blocks_when_thinking_is_enabled(opening):
    thought, content = reference(opening, stop=[END])
    client = anthropic.Anthropic(base_url=opening.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, messages=COPY, max_tokens=2048, stop_sequences=[END], extra_body={"temperature": 0})
    enabled = {"type": "enabled", "budget_tokens": 1024}
    r = client.messages.create(thinking=enabled, **kw)
    assert [b.type for b in r.content] == ["thinking", "text"] and r.content[0].signature
    assert (r.content[0].thinking, r.content[1].text) == (thought, content)
    with client.messages.stream(thinking=enabled, **kw) as stream:
        kinds = {e.delta.type for e in stream if e.type == "content_block_delta"}
        streamed = stream.get_final_message()
    assert kinds == {"thinking_delta", "signature_delta", "text_delta"}
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in r.content]
    omitted = client.messages.create(thinking={**enabled, "display": "omitted"}, **kw)
    assert omitted.content[0].thinking == "" and omitted.content[0].signature == r.content[0].signature
    # without thinking asked for the template closes the block: a reply with no thinking block
    off = client.messages.create(**{**kw, "max_tokens": 8})
    assert [b.type for b in off.content] == ["text"]
    absent, disabled, on = (client.messages.count_tokens(model=MODEL, messages=COPY, **k).input_tokens
                            for k in ({}, {"thinking": {"type": "disabled"}}, {"thinking": enabled}))
    assert absent == disabled > on  # off: the template writes the closed block; on: only its opening


def test_anthropic_thinking_blocks_go_back_as_reasoning_and_only_from_the_assistant(opening):
    client = anthropic.Anthropic(base_url=opening.url, api_key="unused", max_retries=0)
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}

    def count(*blocks):
        messages = [*HI, {"role": "assistant", "content": [*blocks, call]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "20C"}]}]
        return client.messages.count_tokens(model=MODEL, messages=messages, tools=[tool]).input_tokens

    redacted = {"type": "redacted_thinking", "data": "opaque"}
    assert count(redacted) == count() < count({"type": "thinking", "thinking": "Look it up.", "signature": "s"})
    with pytest.raises(anthropic.BadRequestError, match="thinking blocks belong in assistant messages"):
        client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hi"}, {"type": "thinking", "thinking": "x", "signature": "s"}]}])
    with pytest.raises(anthropic.BadRequestError, match="less than max_tokens"):
        client.messages.create(model=MODEL, messages=HI, max_tokens=1024, thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="tool_choice forces tool use"):
        client.messages.create(model=MODEL, messages=HI, max_tokens=2048, thinking={"type": "enabled", "budget_tokens": 1024},
                               tools=[tool], tool_choice={"type": "any"})


def test_ollama_gives_thinking_apart_when_think_is_on(opening):
    thought, content = reference(opening, stop=[END])
    client = ollama.Client(host=opening.url)
    options = {"temperature": 0, "stop": [END], "num_predict": 48}
    r = client.chat(model=MODEL, messages=COPY, think=True, options=options)
    assert (r.message.thinking, r.message.content) == (thought, content)
    pieces = list(client.chat(model=MODEL, messages=COPY, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in pieces) == thought
    assert "".join(p.message.content for p in pieces) == content
    generated = client.generate(model=MODEL, prompt=COPY[0]["content"], think=True, options=options)
    assert (generated.thinking, generated.response) == (thought, content)
    streamed = list(client.generate(model=MODEL, prompt=COPY[0]["content"], think=True, options=options, stream=True))
    assert "".join(p.thinking or "" for p in streamed) == thought and "".join(p.response for p in streamed) == content
    off = client.chat(model=MODEL, messages=COPY, think=False, options={**options, "num_predict": 4})
    assert off.message.thinking is None and off.prompt_eval_count > r.prompt_eval_count  # the closed block


def test_ollama_refuses_think_for_a_model_that_does_not_think(fast_server, opening):
    with pytest.raises(ollama.ResponseError, match="does not support thinking") as e:
        ollama.Client(host=fast_server.url).chat(model=MODEL, messages=HI, think=True)
    assert e.value.status_code == 400
    # clients read whether to send `think` from the model's capabilities
    assert "thinking" not in ollama.Client(host=fast_server.url).show(MODEL).capabilities
    assert "thinking" in ollama.Client(host=opening.url).show(MODEL).capabilities
    assert ollama.Client(host=fast_server.url).chat(model=MODEL, messages=HI, think=False,
                                                    options={"num_predict": 2}).message.thinking is None


def test_responses_give_a_reasoning_item_before_the_message(opening):
    thought, content = reference(opening, max_tokens=24)
    client = oai(opening)
    r = client.responses.create(model=MODEL, input=COPY[0]["content"], temperature=0, max_output_tokens=24)
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output[0].status == "completed"
    assert r.output[0].content[0].text == thought and r.output[0].summary == []
    assert r.output_text == content
    details = r.usage.output_tokens_details
    assert 0 < details.reasoning_tokens < r.usage.output_tokens == 24
    with client.responses.stream(model=MODEL, input=COPY[0]["content"], temperature=0, max_output_tokens=24) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds.index("response.reasoning_text.done") < kinds.index(
        "response.output_text.delta")
    final = events[-1].response
    assert [i.model_dump(exclude={"id"}) for i in final.output] == [i.model_dump(exclude={"id"}) for i in r.output]
    assert final.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    # a summary asked for is the reasoning whole; the conversation goes on past a reasoning item
    summarised = client.responses.create(model=MODEL, input=COPY[0]["content"], temperature=0, max_output_tokens=24,
                                         reasoning={"summary": "auto"})
    assert summarised.output[0].summary[0].text == thought
    after = client.responses.create(model=MODEL, input="And?", previous_response_id=r.id, max_output_tokens=2)
    sent_back = client.responses.create(model=MODEL, max_output_tokens=2,
                                        input=[COPY[0], *[i.model_dump(exclude_none=True) for i in r.output],
                                               {"role": "user", "content": "And?"}], store=False)
    assert after.usage.input_tokens == sent_back.usage.input_tokens
    off = client.responses.create(model=MODEL, input=COPY[0]["content"], max_output_tokens=2, reasoning={"effort": "none"})
    assert off.usage.input_tokens > r.usage.input_tokens and off.output[0].type == "message"  # the closed block
