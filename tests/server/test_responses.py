"""OpenAI's Responses API over a real server, with the official SDK as client: stored responses are
sessions, previous_response_id continues one on its KV, and the output matches a fresh request."""
import json
import time

import httpx
import openai
import pytest
from pydantic import BaseModel

from server.config import EngineConfig

from ..live_server import LiveServer

MODEL = "smollm2-135m-instruct"
KEY, OTHER = "key-a", "key-b"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def server(served_model):
    with LiveServer(served_model, api_keys=(KEY, OTHER)) as s:
        yield s


def client(server, key=KEY):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def stored_ids(server) -> set[str]:
    return {s.id for s in server.engine.sessions if s.persistent}


def greedy(c, **kw):
    return c.responses.create(model=MODEL, temperature=0, **kw)


def test_create_get_input_items_and_delete(server):
    c = client(server)
    r = greedy(c, input="Name a fruit.", instructions="Answer briefly.", max_output_tokens=24)
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed"
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.output_text and "<|im_end|>" not in r.output_text
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    echoed = (r.temperature, r.max_output_tokens, r.instructions, r.store, r.text.format.type, r.tool_choice)
    assert echoed == (0, 24, "Answer briefly.", True, "text", "auto")
    assert r.id in stored_ids(server)  # a stored response is a session under its own id

    assert c.responses.retrieve(r.id).model_dump() == r.model_dump()
    items = c.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Name a fruit.")]

    assert c.responses.delete(r.id) is None  # the SDK reads {"id", "object": "response", "deleted": true}
    assert r.id not in stored_ids(server)
    with pytest.raises(openai.NotFoundError, match=r.id):
        c.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(r.id)


def test_max_output_tokens_cuts_a_response_short(server):
    r = greedy(client(server), input="Tell me a long story about a dragon.", max_output_tokens=3, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.output_text


def test_previous_response_continues_on_its_kv_and_equals_a_fresh_request(server):
    c = client(server)
    first = greedy(c, input="Name a fruit.", max_output_tokens=24)
    parent_tokens = list(server.engine.sessions.get(first.id, KEY).tokens)
    follow = greedy(c, input="What color is it?", previous_response_id=first.id, max_output_tokens=12)
    assert follow.previous_response_id == first.id
    # The whole conversation is the prompt; all of it before the new turn comes from the first response's KV,
    # but for the first response's last token when it was sampled and never run through the model (not
    # when a drafted step checked it: then its KV is there too).
    cached = follow.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens + first.usage.output_tokens - 1 <= cached <= first.usage.input_tokens + first.usage.output_tokens
    assert follow.usage.input_tokens > cached

    whole = [{"role": "user", "content": "Name a fruit."}, *first.output,
             {"role": "user", "content": "What color is it?"}]
    fresh = greedy(c, input=whole, max_output_tokens=12, store=False)
    assert fresh.usage.input_tokens == follow.usage.input_tokens
    assert follow.output_text == fresh.output_text

    # the first response forked: continuing it again is an independent branch with the same greedy text
    again = greedy(c, input="What color is it?", previous_response_id=first.id, max_output_tokens=12)
    assert again.id != follow.id and again.output_text == follow.output_text
    assert again.usage.input_tokens_details.cached_tokens == cached
    assert server.engine.sessions.get(first.id, KEY).tokens == parent_tokens
    third = greedy(c, input="Name another one.", previous_response_id=follow.id, max_output_tokens=8)
    assert third.usage.input_tokens_details.cached_tokens == follow.usage.input_tokens + follow.usage.output_tokens - 1
    own = c.responses.input_items.list(third.id, order="asc").data  # its own input, not the conversation before it
    assert [i.content[0].text for i in own] == ["Name another one."]
    for r in (first, follow, again, third):
        c.responses.delete(r.id)


def test_streamed_create_and_the_stream_helper_give_the_plain_text(server):
    c = client(server)
    prompt = dict(input="Is the sky blue? Answer yes or no.", max_output_tokens=32)
    plain = greedy(c, **prompt, store=False)
    assert plain.status == "completed"

    events = list(c.responses.create(model=MODEL, temperature=0, stream=True, **prompt))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == plain.output_text == final.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert c.responses.retrieve(final.id).output_text == text  # stored as it streamed

    with c.responses.stream(model=MODEL, temperature=0, **prompt) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        helper = stream.get_final_response()
    assert "".join(deltas) == helper.output_text == plain.output_text and helper.status == "completed"
    for r in (final, helper):
        c.responses.delete(r.id)


def test_a_stream_the_client_leaves_is_stored_as_cancelled(server):
    body = {"model": MODEL, "input": "Tell me a long story about a dragon.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = r.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith("data:"))[5:])
        assert created["type"] == "response.created" and created["response"]["status"] == "in_progress"
        deltas = [line for line, _ in zip(lines, range(40)) if '"response.output_text.delta"' in line]
        assert deltas
    rid, c = created["response"]["id"], client(server)
    deadline = time.time() + 10
    while time.time() < deadline and c.responses.retrieve(rid).status == "in_progress":
        time.sleep(0.05)
    stored = c.responses.retrieve(rid)
    assert stored.status == "cancelled" and stored.output_text  # what was streamed stays
    while time.time() < deadline and server.engine.scheduler.has_work():
        time.sleep(0.05)
    c.responses.delete(rid)  # idle again: its request was cancelled, not left running


class City(BaseModel):
    name: str
    country: str


def test_text_format_json_schema_parses_and_matches(server):
    c = client(server)
    r = c.responses.parse(model=MODEL, input="Name a city in France.", text_format=City, temperature=0,
                          max_output_tokens=40, store=False)
    assert r.text.format.type == "json_schema" and r.status == "completed"
    assert isinstance(r.output_parsed, City) and json.loads(r.output_text) == r.output_parsed.model_dump()
    obj = greedy(c, input="Describe a cat as JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=40,
                 store=False)
    assert isinstance(json.loads(obj.output_text), dict)


def test_a_function_call_round_trip(server):
    c = client(server)
    ask = dict(input="What is the weather in Paris?", tools=[WEATHER])
    call = greedy(c, **ask, tool_choice="required", max_output_tokens=40)
    assert [o.type for o in call.output] == ["function_call"] and call.output_text == ""
    fc = call.output[0]
    assert fc.name == "get_weather" and fc.call_id and "city" in json.loads(fc.arguments)
    assert call.tool_choice == "required" and call.tools[0].name == "get_weather"

    result = [{"type": "function_call_output", "call_id": fc.call_id, "output": '{"temperature_c": 21}'}]
    answer = greedy(c, input=result, previous_response_id=call.id, tools=[WEATHER], max_output_tokens=24)
    assert answer.output[0].type == "message" and answer.output_text and "<tool_call>" not in answer.output_text
    whole = [{"role": "user", "content": ask["input"]}, *call.output, *result]
    fresh = greedy(c, input=whole, tools=[WEATHER], max_output_tokens=24, store=False)
    assert fresh.output_text == answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens > call.usage.input_tokens

    # streamed, the call comes as a function_call item with its arguments as deltas
    events = list(c.responses.create(model=MODEL, temperature=0, stream=True, tool_choice="required",
                                     max_output_tokens=40, store=False, **ask))
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    final = events[-1].response
    assert events[-1].type == "response.completed" and [o.type for o in final.output] == ["function_call"]
    assert json.loads(args) == json.loads(done.arguments) == json.loads(fc.arguments)
    assert final.output[0].call_id == events[2].item.call_id

    assert args == fc.arguments

    # too few tokens for any call: refused before a token runs, naming what it needs, streamed or not
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=r"shortest form takes \d+ tokens"):
            c.responses.create(model=MODEL, temperature=0, stream=stream, tool_choice="required",
                               max_output_tokens=12, store=False, **ask)
    for r in (call, answer):
        c.responses.delete(r.id)


def test_store_false_keeps_no_session_and_other_keys_see_nothing(server):
    c, other = client(server), client(server, OTHER)
    before = stored_ids(server)
    r = greedy(c, input="Hi!", max_output_tokens=4, store=False)
    assert r.store is False and stored_ids(server) == before
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)

    mine = greedy(c, input="Hi!", max_output_tokens=4)
    unstored = greedy(c, input="And?", previous_response_id=mine.id, max_output_tokens=4, store=False)
    assert unstored.previous_response_id == mine.id and stored_ids(server) == before | {mine.id}
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError, match=mine.id):
        greedy(other, input="And?", previous_response_id=mine.id, max_output_tokens=4)
    assert c.responses.retrieve(mine.id).id == mine.id
    c.responses.delete(mine.id)


@pytest.mark.parametrize("body, status, says", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, 400,
     "image inputs are not supported"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "'web_search'"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, 400, "'reasoning'"),
    ({"input": [{"type": "web_search_call", "status": "completed"}]}, 400, "item of type 'web_search_call'"),
    ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice needs tools"),
    ({"input": "Hi", "previous_response_id": "resp_missing"}, 404, "resp_missing"),
    ({"input": "Hi", "model": "gpt-9"}, 404, "gpt-9"),
])
def test_refusals_name_their_cause(server, body, status, says):
    r = httpx.post(server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text


def test_stored_responses_follow_session_quotas_and_survive_a_restart(served_model, tmp_path):
    config = EngineConfig(kv_disk=str(tmp_path), max_sessions_per_key=2)
    with LiveServer(served_model, config, api_keys=(KEY,)) as s:
        c = client(s)
        first = greedy(c, input="Name a fruit.", max_output_tokens=16)
        tree = greedy(c, input="Name a tree.", max_output_tokens=4)
        with pytest.raises(openai.RateLimitError, match="max-sessions-per-key"):
            greedy(c, input="Name a bird.", max_output_tokens=4)
        assert greedy(c, input="Name a bird.", max_output_tokens=4, store=False).status == "incomplete"  # no quota
    with LiveServer(served_model, config, api_keys=(KEY,)) as s:
        c = client(s)
        assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
        c.responses.delete(tree.id)
        follow = greedy(c, input="What color is it?", previous_response_id=first.id, max_output_tokens=8)
        # the restarted session's KV comes back from the disk tier, in whole blocks
        block = s.engine.pool.blocks.block_size
        cached = follow.usage.input_tokens_details.cached_tokens
        assert cached % block == 0 and cached >= (first.usage.input_tokens + first.usage.output_tokens) // block * block
