"""A constraint cannot crash or freeze the server: each limit is refused with a 400 naming it, a compile past
its budget is refused, and a grammar that crashes the grammar library costs one child process. /health
answers quickly throughout, measured by a thread polling it while each request runs."""
import anthropic
import httpx
import llguidance
import pytest

from models import load_model
from server.config import EngineConfig
from server.engine.grammar_worker import ConstraintRefused, GrammarWorkers

from ..live_server import HealthWatch, LiveServer

RULE_CHAIN = "start: r0\n" + "".join(f"r{i}: r{i + 1}\n" for i in range(3000)) + 'r3000: "a"\n'
PARENS = "start: " + "(" * 1000 + '"a"' + ")" * 1000
# a choice among 13,000 words as one rule: about a second to compile and mask, many times the budget
WORDS = [f"{i:05d}" + "".join(chr(97 + (i * 7 + k * 13) % 26) for k in range(8)) for i in range(13000)]


def nested_object(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


@pytest.fixture(scope="module")
def server(tiny_checkpoints):
    model = load_model(str(tiny_checkpoints["llama"]))
    with LiveServer(model, EngineConfig(constraint_timeout=0.2), name="tiny") as s:
        yield s


def refused(server, path: str, body: dict) -> str:
    """The 400's message, with /health watched while the request ran."""
    with HealthWatch(server.url) as watch:
        r = httpx.post(server.url + path, json=body, timeout=120)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    # the server decides this; a loaded machine can still delay one poll's thread, hence the margin
    assert watch.failures == 0 and watch.slowest < 0.5, f"/health took {watch.slowest:.3f} s while {path} ran"
    return r.json()["error"]["message"]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("field,value,limit", [
    ("guided_grammar", RULE_CHAIN, "3002 rules; the limit is 1000"),
    ("guided_grammar", PARENS, "nest 1000 deep; the limit is 64"),
    ("guided_regex", "(" * 200 + "a" + ")" * 200, "nest 200 deep; the limit is 64"),
    ("guided_regex", "a" * 1_100_000, "limit of 1048576 bytes"),
    ("guided_json", nested_object(420), "more than 64 levels deep"),
])
def test_each_limit_is_a_400_naming_it(server, field, value, limit):
    message = refused(server, "/v1/chat/completions", {**CHAT, field: value})
    assert limit in message and field in message


def test_the_completions_grammar_field_has_the_same_limits(server):
    body = {"prompt": "hi", "max_tokens": 4, "grammar": RULE_CHAIN}
    assert "rules; the limit is 1000" in refused(server, "/v1/completions", body)


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_a_tool_schema_420_deep_and_too_many_tools_are_400s(server):
    deep = {**CHAT, "tools": [tool("deep", nested_object(420))], "tool_choice": "required"}
    assert "more than 64 levels deep" in refused(server, "/v1/chat/completions", deep)
    many = {**CHAT, "tools": [tool(f"t{i}", {"type": "object"}) for i in range(129)], "tool_choice": "required"}
    assert "at most 128" in refused(server, "/v1/chat/completions", many)  # OpenAI's own limit, in the schema


def test_an_anthropic_input_schema_420_deep_is_a_400_in_anthropic_shape(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               tools=[{"name": "deep", "input_schema": nested_object(420)}])
    assert e.value.body["type"] == "error" and "more than 64 levels deep" in e.value.body["error"]["message"]


def test_a_compile_past_its_budget_is_refused_and_the_next_request_is_served(server):
    words = "start: " + " | ".join(f'"{w}"' for w in WORDS)  # one rule: only its cost is over a limit
    message = refused(server, "/v1/chat/completions", {**CHAT, "guided_grammar": words})
    assert "longer than the 0.2 s budget" in message
    r = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "guided_regex": "[ab]+c"}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_the_ollama_and_tgi_routes_refuse_a_deep_format_in_their_shapes(server):
    r = httpx.post(server.url + "/api/chat", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                   "format": nested_object(420), "stream": False}, timeout=60)
    assert r.status_code == 400 and "more than 64 levels deep" in r.json()["error"]  # Ollama's: a string
    grammar = {"type": "json", "value": nested_object(420)}
    r = httpx.post(server.url + "/generate", json={"inputs": "hi", "parameters": {"grammar": grammar}}, timeout=60)
    assert r.status_code == 400 and "more than 64 levels deep" in r.json()["error"]["message"]


def test_a_grammar_that_crashes_the_library_costs_one_child_not_the_server(smollm):
    """The rule chain above overflows llguidance's stack (a segfault) when it compiles: in a child, the
    check is refused and the next one is answered by a fresh child."""
    tok = smollm.tokenizer
    workers = GrammarWorkers(lambda: {"json": tok.tokenizer.to_str(), "n_vocab": tok.vocab_size,
                                      "eos": sorted(tok.eos_ids)}, size=1, budget_s=120)
    try:
        with pytest.raises(ConstraintRefused, match="the grammar engine failed on it"):
            workers.check(llguidance.LLMatcher.grammar_from_lark(RULE_CHAIN), 512)
        workers.check(llguidance.LLMatcher.grammar_from_regex("[a-z]+"), 512)  # served: no exception
        with pytest.raises(ConstraintRefused, match="language is empty"):
            workers.check(llguidance.LLMatcher.grammar_from_regex("a{3}b{0}[^\\s\\S]"), 512)
    finally:
        workers.close()


def test_a_mask_past_its_budget_ends_the_reply_unmet_and_spares_free_text(tiny_checkpoints):
    """Every mask overruns a budget of a nanosecond: a constrained reply ends at its first token, marked as
    not meeting its constraint, while a reply with no constraint runs to its length."""
    model = load_model(str(tiny_checkpoints["llama"]))
    with LiveServer(model, EngineConfig(mask_timeout=1e-9), name="tiny") as s:
        body = {**CHAT, "max_tokens": 6, "guided_regex": "[a-z]{20}"}
        r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=120).json()
        assert r["choices"][0]["finish_reason"] == "error" and r["usage"]["completion_tokens"] == 1
        free = {**CHAT, "max_tokens": 6, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/chat/completions", json=free, timeout=120).json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 6
