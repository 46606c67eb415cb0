"""gpt-oss's harmony format: the analysis channel is reasoning, a message to `functions.NAME` a structured
call, the final channel the content, in every dialect, whole and streamed; earlier reasoning, calls and
results go back as its template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja, in templates/)
takes them, the prompt at each reasoning effort then the one transformers renders.

A tiny random gpt-oss checkpoint, SmolLM2's vocabulary plus the harmony markers as special tokens, serves
what a grammar makes it write, markers as the special tokens themselves; SmolLM2 under the template (the
markers spelled out in its own vocabulary) copies a reply its system message shows three times, so that the
dialects without a grammar of their own (Responses, Anthropic, Ollama) get harmony replies too."""
import dataclasses
import json

import anthropic
import httpx
import ollama
import pytest
from tokenizers import AddedToken, Tokenizer

from models import load_model
from models.tokenizer import TextTokenizer
from server.api import chat_template, tool_formats
from server.api.tool_formats import harmony

from ..live_server import LiveServer
from ..models.test_moe import write_moe_checkpoint
from .chat_templates import QWEN3, TEMPLATES, oai, with_template

MODEL = "smollm2-135m-instruct"
TEMPLATE = (TEMPLATES / "gpt_oss.jinja").read_text()
MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": SCHEMA}}
ASK = "What is the weather in Paris?"
THOUGHT = "The user wants the weather in Paris, so I call get_weather."
CALLS = ("<|channel|>analysis<|message|>" + THOUGHT + "<|end|><|start|>assistant<|channel|>commentary "
         "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>")
ANSWER_THOUGHT = "The user wants the weather in Paris; I know it is sunny."
ANSWERS = ("<|channel|>analysis<|message|>" + ANSWER_THOUGHT + "<|end|><|start|>assistant<|channel|>final"
           "<|message|>It is sunny in Paris.<|return|>")
# each reply as read: (reasoning, content, calls)
READ = {CALLS: (THOUGHT, None, [("get_weather", {"city": "Paris"})]), ANSWERS: (ANSWER_THOUGHT, "It is sunny in Paris.", [])}


def harmony_tokenizer(smollm) -> TextTokenizer:
    """SmolLM2's vocabulary with the harmony markers added as special tokens, under gpt-oss's template."""
    tok = Tokenizer.from_str(smollm.tokenizer.tokenizer.to_str())
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return TextTokenizer(tok, dataclasses.replace(smollm.tokenizer.meta, chat_template=TEMPLATE))


@pytest.fixture(scope="module")
def gpt_oss_folder(tmp_path_factory, smollm):
    return write_moe_checkpoint(tmp_path_factory.mktemp("gptoss"), "gpt-oss", harmony_tokenizer(smollm), seed=3)


@pytest.fixture(scope="module")
def gpt_oss(gpt_oss_folder):
    with LiveServer(load_model(str(gpt_oss_folder), weights="f32", use_cache=False)) as server:
        yield server


@pytest.fixture(scope="module")
def fewshot(smollm):
    with LiveServer(with_template(smollm, TEMPLATE)) as server:
        yield server


def test_the_format_is_picked_from_the_template():
    assert tool_formats.format_for(TEMPLATE).name == "harmony"
    assert tool_formats.format_for(QWEN3).name == "hermes"


@pytest.mark.parametrize("text, reasoning, content, calls", [
    (CALLS, *READ[CALLS]),
    (ANSWERS, *READ[ANSWERS]),
    # the recipient after the role; the reply cut short before <|call|> (an EOS token is no text)
    ("<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json"
     "<|message|>{\"city\": \"Rome\"}", "Hm.", None, [("get_weather", {"city": "Rome"})]),
    # a preamble on commentary is content; a built-in tool's call is reasoning; nothing after <|call|> is read
    ("<|channel|>commentary<|message|>Looking.<|end|><|start|>assistant to=browser.search<|channel|>analysis"
     "<|message|>{\"q\": 1}<|call|>more", "{\"q\": 1}", "Looking.", []),
    # a call cut short is dropped, never shown; two analysis messages are joined
    ("<|channel|>analysis<|message|>A<|end|><|start|>assistant<|channel|>analysis<|message|>B<|end|><|start|>"
     "assistant<|channel|>commentary to=functions.get_weather<|message|>{\"ci", "A\n\nB", None, []),
    # text that is not harmony loses nothing: an unknown channel, no header at all
    ("<|channel|>notes<|message|>kept<|end|>", None, "kept", []),
    ("Plain text, <|channel|> and all", None, "Plain text, <|channel|> and all", []),
    ("<|channel|>analysis<|message|>cut sh", "cut sh", None, []),
])
def test_a_reply_reads_whole_and_streamed_alike(text, reasoning, content, calls):
    functions = {"get_weather": SCHEMA}
    got = harmony.read(text, functions)
    assert (got[0], got[1], [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got[2]]) == \
           (reasoning, content, calls)
    for size in (1, 3, 7):  # every cut of the text into pieces of this size
        stream, pieces = harmony.HarmonyStream(functions), []
        pieces = [stream.feed(text[at:at + size]) for at in range(0, len(text), size)] + [stream.finish()]
        assert ("".join(p[0] for p in pieces) or None, "".join(p[1] for p in pieces) or None,
                [(d["function"]["name"], json.loads(d["function"]["arguments"])) for p in pieces for d in p[2]]) == \
               (reasoning, content, calls)


def agent_turns() -> list[dict]:
    """An agent's conversation in OpenAI's shape: an earlier answer (its reasoning dropped by the template),
    then a call with its reasoning, its result, and the next question."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
            {"role": "user", "content": ASK},
            {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "20 C, sunny"}]


@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_the_prompt_is_the_one_transformers_renders(gpt_oss, gpt_oss_folder, effort):
    """Reasoning goes back as `thinking`, a call's arguments as an object, and reasoning_effort reaches the
    template as its variable."""
    import transformers

    turns = agent_turns()
    body = {"messages": turns, "tools": [WEATHER], **({"reasoning_effort": effort} if effort else {})}
    ours = httpx.post(gpt_oss.url + "/tokenize", json=body).json()["tokens"]
    hf_turns = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in turns]
    hf_turns[2]["thinking"] = "A greeting."
    hf_turns[4] = {"role": "assistant", "content": "", "thinking": THOUGHT, "tool_calls": [
        {**turns[4]["tool_calls"][0], "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    hf = transformers.AutoTokenizer.from_pretrained(gpt_oss_folder)
    text = hf.apply_chat_template(hf_turns, tools=[WEATHER], tokenize=False, add_generation_prompt=True,
                                  **({"reasoning_effort": effort} if effort else {}))
    assert f"Reasoning: {effort or 'medium'}" in text and THOUGHT in text and "A greeting." not in text
    assert gpt_oss.engine.tokenizer.decode(ours, skip_special=False) == text
    assert ours == hf(text, add_special_tokens=False)["input_ids"]


def test_reasoning_effort_is_refused_by_a_model_that_does_not_think(smollm_server):
    r = oai(smollm_server).chat.completions.with_raw_response
    with pytest.raises(Exception) as e:
        r.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, reasoning_effort="high")
    assert e.value.status_code == 400 and "reasoning_effort" in str(e.value)


def lark(text: str) -> str:
    """A grammar whose one output is `text`, its harmony markers the special tokens themselves."""
    parts, at = [], 0
    while at < len(text):
        marker = next((m for m in MARKERS if text.startswith(m, at)), None)
        if marker is not None:
            parts.append(marker)
            at += len(marker)
            continue
        end = min([i for m in MARKERS if (i := text.find(m, at)) >= 0] or [len(text)])
        parts.append(json.dumps(text[at:end]))
        at = end
    return "start: " + " ".join(parts)


def shown(reply: str) -> str:
    """A system message showing the reply to ASK three times, for SmolLM2 to copy (its markers plain text)."""
    return "Answer as in these examples.\n\n" + f"<|start|>user<|message|>{ASK}<|end|><|start|>assistant{reply}\n" * 3


def openai_chat(server, system: str | None, stream: bool, **kw):
    """The chat reply to ASK -> (reasoning, content, [(name, arguments)], finish reason)."""
    messages = [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": ASK}]
    r = oai(server).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0,
                                            stream=stream, max_tokens=80, **kw)
    if not stream:
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        return m.reasoning_content, m.content, calls, r.choices[0].finish_reason
    reasoning, content, calls, reason = "", "", {}, None
    for chunk in r:
        delta, reason = chunk.choices[0].delta, chunk.choices[0].finish_reason or reason
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        for d in delta.tool_calls or []:
            name, arguments = calls.get(d.index, ("", ""))
            calls[d.index] = (name + (d.function.name or ""), arguments + (d.function.arguments or ""))
    return reasoning or None, content or None, [(n, json.loads(a)) for n, a in calls.values()], reason


REPLIES = pytest.mark.parametrize("reply", [CALLS, ANSWERS], ids=["call", "answer"])


@pytest.mark.parametrize("stream", [False, True])
@REPLIES
def test_openai_chat_reads_the_channels_of_gpt_oss(gpt_oss, reply, stream):
    """The markers come as special tokens (one token each): the reply keeps them in its text."""
    written = reply.removesuffix("<|call|>").removesuffix("<|return|>")  # an EOS token's, in gpt-oss's vocabulary
    got = openai_chat(gpt_oss, None, stream, extra_body={"guided_grammar": lark(written)})
    assert got == (*READ[reply], "tool_calls" if reply == CALLS else "stop")
    if not stream:  # each marker one token
        r = oai(gpt_oss).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=80,
                                                 logprobs=True, extra_body={"guided_grammar": lark(written)})
        assert [t.token for t in r.choices[0].logprobs.content][:3] == ["<|channel|>", "analysis", "<|message|>"]


@pytest.mark.parametrize("stream", [False, True])
@REPLIES
def test_openai_chat_reads_a_copied_reply(fewshot, reply, stream):
    """<|call|> and <|return|> end the reply where they are no EOS token."""
    got = openai_chat(fewshot, shown(reply), stream)
    assert got == (*READ[reply], "tool_calls" if reply == CALLS else "stop")


@pytest.mark.parametrize("stream", [False, True])
@REPLIES
def test_responses_read_reasoning_items_and_calls(fewshot, reply, stream):
    kw = dict(model=MODEL, instructions=shown(reply), input=ASK, temperature=0, max_output_tokens=80,
              tools=[{"type": "function", **WEATHER["function"]}], reasoning={"effort": "high"})
    if stream:
        with oai(fewshot).responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = oai(fewshot).responses.create(**kw)
    reasoning, content, calls = READ[reply]
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == reasoning
    if calls:
        assert [(i.type, i.name, json.loads(i.arguments)) for i in r.output[1:]] == [("function_call", *calls[0])]
    else:
        assert [(i.type, i.content[0].text) for i in r.output[1:]] == [("message", content)]
    assert r.status == "completed" and r.usage.output_tokens_details.reasoning_tokens > 0


def anthropic_message(client, stream: bool, **kw):
    """The final message, streamed or not."""
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
@REPLIES
def test_anthropic_reads_a_thinking_block_and_tool_use(fewshot, reply, stream):
    client = anthropic.Anthropic(base_url=fewshot.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, system=shown(reply), messages=[{"role": "user", "content": ASK}], max_tokens=2000,
              thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0},
              tools=[{"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}])
    message = anthropic_message(client, stream, **kw)
    reasoning, content, calls = READ[reply]
    blocks = [(b.type, b.thinking if b.type == "thinking" else b.text if b.type == "text" else (b.name, b.input))
              for b in message.content]
    assert blocks == [("thinking", reasoning), *[("tool_use", c) for c in calls], *([("text", content)] if content else [])]
    assert message.stop_reason == ("tool_use" if calls else "end_turn")


@pytest.mark.parametrize("stream", [False, True])
@REPLIES
def test_ollama_reads_thinking_and_tool_calls(fewshot, reply, stream):
    messages = [{"role": "system", "content": shown(reply)}, {"role": "user", "content": ASK}]
    out = ollama.Client(host=fewshot.url).chat(model=MODEL, messages=messages, tools=[WEATHER], stream=stream,
                                               think="high", options={"temperature": 0, "num_predict": 80})
    parts = list(out) if stream else [out]
    calls = [(c.function.name, dict(c.function.arguments)) for p in parts for c in p.message.tool_calls or []]
    got = ("".join(p.message.thinking or "" for p in parts), "".join(p.message.content or "" for p in parts) or None, calls)
    assert got == READ[reply] and parts[-1].done


HEADER = " to=functions.get_weather<|channel|>commentary json<|message|>"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_is_a_harmony_call_in_every_dialect(gpt_oss, stream):
    """tool_choice "required" (Anthropic's "any"): the grammar writes the call as the template writes it, its
    markers the special tokens themselves, and each dialect reads it back as its structured call."""
    r = oai(gpt_oss).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=[WEATHER],
                                             tool_choice="required", max_tokens=40, logprobs=True, stream=stream)
    if stream:
        chunks = [c.choices[0] for c in r]
        tokens = [t.token for c in chunks if c.logprobs for t in c.logprobs.content]
        names = [d.function.name for c in chunks for d in c.delta.tool_calls or [] if d.function.name]
        reason = chunks[-1].finish_reason
    else:
        tokens = [t.token for t in r.choices[0].logprobs.content]
        names = [c.function.name for c in r.choices[0].message.tool_calls]
        reason = r.choices[0].finish_reason
    assert "".join(tokens).startswith(HEADER) and "<|channel|>" in tokens and "<|message|>" in tokens, tokens
    assert names == ["get_weather"] and reason == "tool_calls"

    kw = dict(model=MODEL, input=ASK, max_output_tokens=40, tools=[{"type": "function", **WEATHER["function"]}],
              tool_choice="required")
    if stream:
        with oai(gpt_oss).responses.stream(**kw) as s:
            response = s.get_final_response()
    else:
        response = oai(gpt_oss).responses.create(**kw)
    assert [(i.type, i.name) for i in response.output if i.type == "function_call"] == [("function_call", "get_weather")]
    assert isinstance(json.loads(response.output[-1].arguments), dict) and response.status == "completed"

    client = anthropic.Anthropic(base_url=gpt_oss.url, api_key="unused", max_retries=0)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=40, tool_choice={"type": "any"},
              tools=[{"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}])
    message = anthropic_message(client, stream, **kw)
    assert [(b.type, b.name) for b in message.content if b.type == "tool_use"] == [("tool_use", "get_weather")]
    assert message.stop_reason == "tool_use"


def test_each_dialect_s_effort_reaches_the_template(smollm):
    """OpenAI's and Ollama's levels as they are, the least below low and xhigh as high; Anthropic's effort, or
    else its thinking budget's size."""
    from server.api.anthropic import _effort
    from server.api.anthropic_schemas import MessagesRequest

    tok = with_template(smollm, TEMPLATE).tokenizer
    assert [chat_template.effort_variables(tok, e, "reasoning_effort") for e in ("none", "minimal", "medium", "xhigh")] \
        == [{"reasoning_effort": e} for e in ("low", "low", "medium", "high")]
    assert chat_template.effort_variables(with_template(smollm, QWEN3).tokenizer, "none", "x") == {"enable_thinking": False}

    def anthropic_effort(**kw) -> str | None:
        return _effort(MessagesRequest(model=MODEL, max_tokens=40000, messages=[{"role": "user", "content": "Hi"}], **kw))

    thinking = [{"type": "enabled", "budget_tokens": b} for b in (1024, 8000, 32000)]
    assert [anthropic_effort(thinking=t) for t in thinking] == ["low", "medium", "high"]
    assert anthropic_effort(thinking=thinking[0], output_config={"effort": "high"}) == "high"
    assert anthropic_effort() is None
