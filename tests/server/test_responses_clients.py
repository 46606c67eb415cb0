"""What Responses clients send and read, over a real server: the OpenAI Agents SDK's requests (which
always carry `include`), the output text's logprobs, `completed_at`, string error codes, and a function
call output that answers no call."""
import asyncio
import json
import typing

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
from openai.types.responses import ResponseIncludable

MODEL = "smollm2-135m-instruct"
LOGPROBS = "message.output_text.logprobs"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def greedy(c, **kw):
    return c.responses.create(model=MODEL, temperature=0, **kw)


def stored(server) -> set[str]:
    return {s.id for s in server.engine.sessions if s.persistent}


def test_include_is_taken_and_its_logprobs_are_the_chat_routes(fast_server):
    c = client(fast_server)
    ask = dict(input="Name a fruit.", max_output_tokens=8, store=False)
    plain = greedy(c, include=[], **ask)
    assert plain.status in ("completed", "incomplete") and plain.output[0].content[0].logprobs is None
    others = [v for v in typing.get_args(ResponseIncludable) if v != LOGPROBS]
    assert greedy(c, include=others, **ask).output[0].content[0].logprobs is None  # nothing kvserve makes

    part = greedy(c, include=[LOGPROBS], top_logprobs=2, **ask).output[0].content[0]
    assert part.text == plain.output_text and "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    chat = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=8, logprobs=True, top_logprobs=2,
                                     messages=[{"role": "user", "content": "Name a fruit."}])
    shown = [lp for lp in chat.choices[0].logprobs.content if lp.token != "<|im_end|>"]  # the end shows no text
    assert [lp.token for lp in part.logprobs] == [lp.token for lp in shown]
    assert [lp.logprob for lp in part.logprobs] == pytest.approx([lp.logprob for lp in shown], abs=1e-4)

    events = list(c.responses.create(model=MODEL, temperature=0, stream=True, include=[LOGPROBS], top_logprobs=2,
                                     **ask))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response.output[0].content[0]
    assert streamed == [lp.token for lp in done.logprobs] == [lp.token for lp in final.logprobs] == \
        [lp.token for lp in part.logprobs]

    r = httpx.post(fast_server.url + "/v1/responses", json={"input": "Hi", "include": ["message.bogus"]})
    assert r.status_code == 400 and "include" in r.json()["error"]["message"]


def test_completed_at_is_set_when_completed(fast_server):
    c = client(fast_server)
    done = greedy(c, input="Say OK.", max_output_tokens=40, store=False)
    assert done.status == "completed" and done.completed_at >= done.created_at
    cut = greedy(c, input="Tell me a long story about a dragon.", max_output_tokens=2, store=False)
    assert cut.status == "incomplete" and cut.completed_at is None


def test_errors_on_responses_routes_carry_string_codes(fast_server):
    url = fast_server.url
    cases = [(httpx.post(url + "/v1/responses", json={"input": "Hi", "model": "gpt-9"}), 404, "model_not_found"),
             (httpx.post(url + "/v1/responses", json={"input": "Hi", "previous_response_id": "resp_gone"}), 404,
              "previous_response_not_found"),
             (httpx.get(url + "/v1/responses/resp_gone"), 404, None),
             (httpx.post(url + "/v1/responses", json={"input": "Hi", "bogus": 1}), 400, None)]
    for r, status, code in cases:
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    with pytest.raises(openai.NotFoundError) as e:
        client(fast_server).responses.create(model="gpt-9", input="Hi")
    assert e.value.code == "model_not_found"
    assert httpx.post(url + "/v1/chat/completions", json={}).json()["error"]["code"] == 400  # vLLM's, elsewhere


def test_a_function_call_output_must_answer_a_call(fast_server):
    c, before = client(fast_server), stored(fast_server)
    orphan = [{"role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call_output", "call_id": "call_nowhere", "output": '{"temperature_c": 21}'}]
    with pytest.raises(openai.BadRequestError,
                       match="No tool call found for function call output with call_id call_nowhere") as e:
        greedy(c, input=orphan, tools=[WEATHER], max_output_tokens=4)
    assert e.value.code is None and stored(fast_server) == before  # refused before anything was stored

    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    answered = [orphan[0], call, {**orphan[1], "call_id": "call_1"}]
    assert greedy(c, input=answered, tools=[WEATHER], max_output_tokens=2, store=False).status
    first = greedy(c, input=answered[:2], tools=[WEATHER], max_output_tokens=2)  # the call, then its output later
    later = greedy(c, input=answered[2:], previous_response_id=first.id, tools=[WEATHER], max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="call_nowhere"):
        greedy(c, input=orphan[1:], previous_response_id=first.id, tools=[WEATHER], max_output_tokens=2)
    for r in (first, later):
        c.responses.delete(r.id)


def test_the_agents_sdk_runs_an_agent_through_responses(fast_server):
    sent: list[dict] = []

    async def record(request: httpx.Request) -> None:
        if request.url.path.endswith("/responses"):
            sent.append(json.loads(await request.aread()))

    async def run():
        async with httpx.AsyncClient(event_hooks={"request": [record]}) as http:
            api = openai.AsyncOpenAI(base_url=fast_server.url + "/v1", api_key="unused", max_retries=0,
                                     http_client=http)
            agent = Agent(name="Helper", instructions="Answer in one short sentence.",
                          model=OpenAIResponsesModel(MODEL, api),
                          model_settings=ModelSettings(temperature=0, max_tokens=64))
            return await Runner.run(agent, "Say OK.", run_config=RunConfig(tracing_disabled=True))

    result = asyncio.run(run())
    assert isinstance(result.final_output, str) and result.final_output
    (body,) = sent
    assert body["include"] == [] and body["model"] == MODEL and body["instructions"] == "Answer in one short sentence."
    assert [(i.get("role"), i.get("content")) for i in body["input"]] == [("user", "Say OK.")]
    for raw in result.raw_responses:
        client(fast_server).responses.delete(raw.response_id)
