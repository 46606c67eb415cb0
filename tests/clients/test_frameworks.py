"""Agent frameworks and gateways over a live kvserve, each through its own PyPI package, written as its
users write it: the OpenAI Agents SDK (Responses), instructor, pydantic-ai (OpenAI and Anthropic models),
LangChain's Anthropic and Ollama chat models, LiteLLM (openai/, ollama_chat/, anthropic/) and the ollama
client with Ollama's default options, plus embeddings through the ollama and openai SDKs.

The model is SmolLM2-135M: the tests check that each framework's requests are taken and its replies read
(shapes, types, one request where one is due), not what the model says."""
from __future__ import annotations

import asyncio
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM fetches a price list at import otherwise

import pytest
from pydantic import BaseModel

MODEL = "smollm2-135m-instruct"
KEY = "unused"  # the shared server takes no key; every SDK wants one


class Address(BaseModel):
    city: str


class User(BaseModel):
    name: str
    age: int
    address: Address


class City(BaseModel):
    city: str
    country: str


def weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny and 21 C in {city}."


# ---------------------------------------------------------------- OpenAI Agents SDK (Responses API)

def _agents_agent(url):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    model = OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = Agent(name="Assistant", instructions="You are a helpful assistant. Answer in one short sentence.",
                  model=model, tools=[function_tool(weather)],
                  model_settings=ModelSettings(max_tokens=64, temperature=0))
    return client, agent


def _completed(result) -> bool:
    """A string final output, or a call of the tool among the run's items."""
    from agents.items import ToolCallItem

    return isinstance(result.final_output, str) or any(isinstance(i, ToolCallItem) for i in result.new_items)


@pytest.mark.timeout(180)
def test_openai_agents_run_with_a_function_tool(fast_server):
    from agents import Runner

    async def run():
        client, agent = _agents_agent(fast_server.url)
        async with client:  # closed in this loop, not by the collector after it
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    result = asyncio.run(run())
    assert _completed(result), result.new_items
    assert result.last_response_id and result.last_response_id.startswith("resp")
    assert all(r.usage.output_tokens <= 64 for r in result.raw_responses)


@pytest.mark.timeout(180)
def test_openai_agents_run_streamed(fast_server):
    from agents import Runner

    async def run():
        client, agent = _agents_agent(fast_server.url)
        async with client:
            result = Runner.run_streamed(agent, input="Say hello.", max_turns=4)
            kinds = [event.type async for event in result.stream_events()]
            return result, kinds

    result, kinds = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
    assert result.is_complete and _completed(result), result.new_items
    assert result.last_response_id


@pytest.mark.timeout(180)
def test_openai_agents_two_turns_by_previous_response_id(fast_server):
    from agents import Runner

    async def run():
        client, agent = _agents_agent(fast_server.url)
        async with client:
            first = await Runner.run(agent, "My name is Ada. Say hi.", max_turns=4)
            second = await Runner.run(agent, "What is my name?", previous_response_id=first.last_response_id,
                                      max_turns=4)
            return first, second

    first, second = asyncio.run(run())
    assert _completed(first) and _completed(second)
    assert second.last_response_id and second.last_response_id != first.last_response_id
    # the second request sent only the new turn; the server read the first from the stored response
    assert second.raw_responses[0].usage.input_tokens > first.raw_responses[0].usage.input_tokens


@pytest.mark.timeout(300)
def test_openai_agents_forced_tool_loop_within_80_tokens_a_turn(fast_server):
    """tool_choice "required" with max_tokens 80 on every turn: each of three turns' responses completes
    with a call (written compactly) and the loop runs its tool each time, never `incomplete`."""
    from agents import Runner
    from agents.exceptions import MaxTurnsExceeded

    async def run():
        client, agent = _agents_agent(fast_server.url)
        # (reset_tool_choice off: every turn is forced, so the run takes all three turns)
        agent = agent.clone(reset_tool_choice=False, model_settings=agent.model_settings.resolve(
            agent.model_settings.__class__(tool_choice="required", max_tokens=80)))
        async with client:
            try:
                return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
            except MaxTurnsExceeded as e:  # the model may call again each turn: the turns it ran are the point
                return e.run_data

    result = asyncio.run(run())
    responses = result.raw_responses
    assert len(responses) == 3, result
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert calls and calls[0].raw_item.name == "weather"
    assert all(r.usage.output_tokens <= 80 for r in responses)
    assert len([i for i in result.new_items if i.type == "tool_call_output_item"]) >= 3


# ---------------------------------------------------------------- instructor

def _instructor(url, mode):
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0), mode=mode)
    sent = []
    client.on("completion:kwargs", lambda *a, **kw: sent.append(kw))
    return client, sent


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_nested_model_in_one_request(fast_server, mode):
    """The schema goes to the server (a forced tool call, or response_format json_schema), whose constraint
    makes the first reply a valid User."""
    import instructor

    client, sent = _instructor(fast_server.url, getattr(instructor.Mode, mode))
    user, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=User, max_retries=0, max_tokens=200, temperature=0,
        messages=[{"role": "user", "content": "Extract: Jason is 25 years old and lives in Paris."}])
    assert isinstance(user, User) and isinstance(user.address, Address) and isinstance(user.age, int)
    assert len(sent) == 1
    if mode == "TOOLS":
        assert sent[0]["tool_choice"]["function"]["name"] == "User"
        assert completion.choices[0].message.tool_calls[0].function.name == "User"
    else:
        assert sent[0]["response_format"]["type"] == "json_schema"
    assert completion.choices[0].finish_reason in ("stop", "tool_calls")  # the constraint closed it


@pytest.mark.timeout(120)
def test_instructor_json_mode(fast_server):
    """Mode.JSON sends the schema in a system message and response_format {"type": "json_object"}, which
    (as OpenAI's) holds the reply to some JSON object, not to the schema. SmolLM2's object leaves out
    `address`, on the retry too: then instructor raises, and the test checks what the server owes, a JSON
    object ended by "stop" in each reply."""
    import json

    import instructor
    from instructor.core.exceptions import InstructorRetryException
    from pydantic import ValidationError

    client, sent = _instructor(fast_server.url, instructor.Mode.JSON)
    ask = dict(model=MODEL, response_model=User, max_retries=1, max_tokens=200, temperature=0,
               messages=[{"role": "user", "content": "Extract: Jason is 25 years old and lives in Paris."}])
    try:
        user, completion = client.chat.completions.create_with_completion(**ask)
        replies = [completion]
        assert isinstance(user, User) and isinstance(user.address, Address)
    except InstructorRetryException as e:
        assert all(isinstance(f.exception, ValidationError) for f in e.failed_attempts), e.failed_attempts
        replies = [f.completion for f in e.failed_attempts]
        assert len(replies) == 2
    assert 1 <= len(sent) <= 2 and all(kw["response_format"] == {"type": "json_object"} for kw in sent)
    for reply in replies:
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
        assert reply.choices[0].finish_reason == "stop" and reply.usage.completion_tokens < 100


# ---------------------------------------------------------------- pydantic-ai

def _pydantic_ai_model(kind, url):
    if kind == "openai":
        from pydantic_ai.models.openai import OpenAIChatModel
        from pydantic_ai.providers.openai import OpenAIProvider

        return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1", api_key=KEY))
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    return AnthropicModel(MODEL, provider=AnthropicProvider(base_url=url, api_key=KEY))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_pydantic_ai_agent_with_a_tool_and_structured_output(fast_server, kind):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart
    from pydantic_ai.usage import UsageLimits

    agent = Agent(_pydantic_ai_model(kind, fast_server.url), output_type=City, tools=[weather],
                  instructions="Answer with the city and its country.", retries={"tools": 1, "output": 2})
    settings = {"max_tokens": 200, "temperature": 0}
    if kind == "anthropic":  # as pydantic-ai's warning says: it drops sampling settings for the SDK's newer version
        settings["extra_headers"] = {"anthropic-version": "2023-06-01"}
    result = agent.run_sync("Which country is Paris in?", model_settings=settings,
                            usage_limits=UsageLimits(request_limit=6))
    assert isinstance(result.output, City)
    messages = result.all_messages()
    responses = [m for m in messages if isinstance(m, ModelResponse)]
    assert isinstance(messages[0], ModelRequest) and responses and responses[-1].model_name
    calls = [p for m in responses for p in m.parts if isinstance(p, ToolCallPart)]
    assert {c.tool_name for c in calls} <= {"weather", "final_result"}
    assert "final_result" in {p.tool_name for p in responses[-1].parts if isinstance(p, ToolCallPart)}
    answered = {p.tool_call_id for m in messages if isinstance(m, ModelRequest) for p in m.parts
                if isinstance(p, ToolReturnPart)}
    # each earlier call was answered in the next request, which the server took
    assert all(c.tool_call_id in answered for m in responses[:-1] for c in m.parts if isinstance(c, ToolCallPart))
    assert result.usage.requests == len(responses) and result.usage.output_tokens > 0


# ---------------------------------------------------------------- LangChain

def _chat_anthropic(url):
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(base_url=url, api_key=KEY, model=MODEL, max_tokens=64, temperature=0, max_retries=0)


@pytest.mark.timeout(120)
def test_langchain_anthropic_invoke_and_stream(fast_server):
    from langchain_core.messages import AIMessage, AIMessageChunk

    llm = _chat_anthropic(fast_server.url)
    reply = llm.invoke("Say hello in one word.")
    assert isinstance(reply, AIMessage) and reply.text and reply.response_metadata["model_name"] == MODEL
    assert reply.usage_metadata["output_tokens"] <= 64
    chunks = list(llm.stream("Say hello in one word."))
    assert chunks and all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = sum(chunks[1:], chunks[0])
    assert whole.text and whole.usage_metadata["output_tokens"] <= 64


@pytest.mark.timeout(120)
def test_langchain_anthropic_structured_output_json_schema(fast_server):
    structured = _chat_anthropic(fast_server.url).with_structured_output(City, method="json_schema")
    city = structured.invoke("Which country is Paris in? Give the city and the country.")
    assert isinstance(city, City)


def _chat_ollama(url):
    from langchain_ollama import ChatOllama

    return ChatOllama(base_url=url, model=MODEL, num_predict=64, temperature=0)


@pytest.mark.timeout(120)
def test_langchain_ollama_invoke_and_stream(fast_server):
    from langchain_core.messages import AIMessage

    llm = _chat_ollama(fast_server.url)
    reply = llm.invoke("Say hello in one word.")
    assert isinstance(reply, AIMessage) and reply.text and reply.response_metadata["model"] == MODEL
    assert reply.usage_metadata["output_tokens"] <= 64
    chunks = list(llm.stream("Say hello in one word."))
    whole = sum(chunks[1:], chunks[0])
    assert whole.text and whole.response_metadata.get("done") is True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["json_schema", "json_mode"])
def test_langchain_ollama_structured_output(fast_server, method):
    llm = _chat_ollama(fast_server.url)
    llm.num_predict = 200
    city = llm.with_structured_output(City, method=method).invoke(
        "Which country is Paris in? Answer in JSON with the keys city and country.")
    assert isinstance(city, City)


@pytest.mark.timeout(120)
def test_langchain_ollama_structured_output_by_function_calling(fast_server):
    """Ollama's API has no tool_choice, so a model may answer in text instead of calling the schema's tool
    (SmolLM2 does here, as it would under Ollama): then LangChain parses None. The request is taken either way."""
    from langchain_core.messages import AIMessage

    llm = _chat_ollama(fast_server.url)
    llm.num_predict = 200
    out = llm.with_structured_output(City, method="function_calling", include_raw=True).invoke(
        "Which country is Paris in? Answer in JSON with the keys city and country.")
    assert isinstance(out["raw"], AIMessage) and out["parsing_error"] is None
    assert isinstance(out["parsed"], City) or (out["parsed"] is None and out["raw"].content and
                                               not out["raw"].tool_calls)


# ---------------------------------------------------------------- LiteLLM

@pytest.mark.timeout(120)
@pytest.mark.parametrize("prefix, path", [("openai", "/v1"), ("ollama_chat", ""), ("anthropic", "")])
def test_litellm_completion(fast_server, prefix, path):
    import litellm

    reply = litellm.completion(model=f"{prefix}/{MODEL}", api_base=fast_server.url + path, api_key=KEY,
                               messages=[{"role": "user", "content": "Say hello in one word."}], max_tokens=32,
                               temperature=0, num_retries=0)
    text = reply.choices[0].message.content
    assert isinstance(text, str) and text.strip()
    assert reply.choices[0].finish_reason in ("stop", "length") and 0 < reply.usage.completion_tokens <= 32


# ---------------------------------------------------------------- ollama client, and embeddings

OLLAMA_DEFAULTS = dict(  # Ollama's DefaultOptions (api/types.go), as `ollama run` sends them
    num_keep=4, seed=-1, temperature=0.8, top_k=40, top_p=0.9, typical_p=1.0, repeat_last_n=64,
    repeat_penalty=1.1, presence_penalty=0.0, frequency_penalty=0.0, mirostat=0, mirostat_tau=5.0,
    mirostat_eta=0.1, tfs_z=1.0, penalize_newline=True, num_ctx=2048, num_batch=512, num_gpu=-1, num_thread=0,
    use_mmap=True, use_mlock=False, numa=False, low_vram=False, f16_kv=True, vocab_only=False,
)


@pytest.mark.timeout(120)
def test_ollama_client_with_ollamas_default_options_and_a_tag(fast_server):
    import ollama

    client = ollama.Client(host=fast_server.url)
    options = ollama.Options(**OLLAMA_DEFAULTS, num_predict=48)
    messages = [{"role": "user", "content": "Say hello in one word."}]
    reply = client.chat(model=MODEL + ":latest", messages=messages, options=options)
    # sampled (temperature 0.8, a random seed): the shapes, not the words
    assert reply.done and reply.message.role == "assistant" and isinstance(reply.message.content, str)
    assert reply.model == MODEL + ":latest" and 0 < reply.eval_count <= 48 and reply.prompt_eval_count > 0
    parts = list(client.chat(model=MODEL + ":latest", messages=messages, options=options, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and 0 < parts[-1].eval_count <= 48
    generated = client.generate(model=MODEL + ":latest", prompt="Once upon a time", options=options)
    assert generated.done and isinstance(generated.response, str) and generated.context
    assert MODEL + ":latest" in {m.model for m in client.list().models}


@pytest.mark.timeout(60)
def test_ollama_client_embed(fast_server):
    import ollama

    client = ollama.Client(host=fast_server.url)
    out = client.embed(model=MODEL + ":latest", input=["The cat sat on the mat.", "Dogs bark."])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == len(out.embeddings[1]) > 0
    assert sum(x * x for x in out.embeddings[0]) == pytest.approx(1.0, abs=1e-3)  # Ollama normalizes


@pytest.mark.timeout(60)
def test_openai_sdk_embeddings(fast_server):
    from openai import OpenAI

    client = OpenAI(base_url=fast_server.url + "/v1", api_key=KEY, max_retries=0)
    out = client.embeddings.create(model=MODEL, input=["The cat sat on the mat.", "Dogs bark."])
    assert [d.index for d in out.data] == [0, 1] and len(out.data[0].embedding) > 0
    assert out.model == MODEL and out.usage.prompt_tokens > 0
