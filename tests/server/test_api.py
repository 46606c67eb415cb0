import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from huggingface_hub import InferenceClient

from kvcache import REGISTRY
from models.catalog import DEFAULT_WEIGHTS
from models.loader import resolve_weights
from server.api.generation import output_stream
from server.engine.sampling import SamplingParams
from server.engine.sequence import Finished

from ..live_server import metric
from ..models.test_fidelity import greedy_alone

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France? Answer in one sentence."


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def gen(url, inputs, n=12, session=None, **params):
    body = {"inputs": inputs, "parameters": {"max_new_tokens": n, "details": True, **params}}
    if session:
        body["session_id"] = session
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["generated_text"], [t["id"] for t in out["details"]["tokens"]]


def test_openai_chat_and_stream_match_cli_generate(fast_server):
    c = client(fast_server)
    messages = [{"role": "user", "content": QUESTION}]
    resp = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24)
    text = resp.choices[0].message.content
    assert "Paris" in text
    assert resp.usage.prompt_tokens > 10 and resp.usage.completion_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.choices[0].finish_reason in ("stop", "length")

    chunks = list(c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == resp.choices[0].finish_reason

    cli = subprocess.run([sys.executable, "-m", "server.cli", "generate", "--model", MODEL, "--max-tokens", "24", QUESTION],
                         capture_output=True, text=True, timeout=600)
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == text.strip()

    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_openai_completions_logprobs_and_errors(fast_server):
    c = client(fast_server)
    r = c.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs)
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=7)
    assert "temperature" in str(err.value)


def test_huggingface_inference_client_streams_tgi(fast_server):
    hf = InferenceClient(base_url=fast_server.url + "/generate_stream")
    prompt = "The three primary colors are"
    events = list(hf.text_generation(prompt, max_new_tokens=10, stream=True, details=True))
    assert len(events) == 10
    assert events[-1].details.finish_reason == "length" and events[-1].details.generated_tokens == 10
    text = "".join(e.token.text for e in events)
    assert events[-1].generated_text == text
    assert text == gen(fast_server.url, prompt, 10)[0]
    plain = InferenceClient(base_url=fast_server.url)
    assert plain.text_generation(prompt, max_new_tokens=10) == text


def test_concurrent_streams_equal_solo_runs(smollm_server):
    # exact weights: batched and alone must agree bit for bit, which q4's kernels promise only up to float order
    url = smollm_server.url
    prompts = [f"Write a short fact about the number {i}:" for i in range(16)]
    solo = [gen(url, p, 12)[1] for p in prompts]
    before_count = metric(url, "kvserve:step_num_sessions_count")
    before_single = metric(url, 'kvserve:step_num_sessions_bucket{le="1.0"')

    async def stream(ac, p):
        ids = []
        async with ac.stream("POST", url + "/generate_stream", json={"inputs": p, "parameters": {"max_new_tokens": 12}}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    ids.append(json.loads(line[5:])["token"]["id"])
        return ids

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as ac:
            return await asyncio.gather(*(stream(ac, p) for p in prompts))

    together = asyncio.run(run_all())
    assert together == solo
    steps = metric(url, "kvserve:step_num_sessions_count") - before_count
    single = metric(url, 'kvserve:step_num_sessions_bucket{le="1.0"') - before_single
    assert steps > 0 and single < steps, "no step batched more than one session"
    total = metric(url, "kvserve:step_num_sessions_sum")
    assert total > metric(url, "kvserve:step_num_sessions_count")


def test_session_turns_equal_one_whole_request_and_prefill_only_new_tokens(fast_server):
    url = fast_server.url
    c = client(fast_server)
    sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    turns = ["Name a fruit.", "What color is it?", "Name another one."]
    messages, outputs = [], []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        before = metric(url, "kvserve:prompt_tokens_total")
        r = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                      extra_headers={"X-Session-Id": sid})
        prefilled = metric(url, "kvserve:prompt_tokens_total") - before
        whole = c.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
        assert r.choices[0].message.content == whole.choices[0].message.content
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert prefilled == r.usage.prompt_tokens - cached
        if i == 0:  # only whole blocks of a prefix other requests left in the pool (the chat template's system prompt)
            assert cached % 16 == 0 and cached < r.usage.prompt_tokens
        else:
            assert cached > 20
            assert prefilled < r.usage.prompt_tokens - 20
        outputs.append(r.choices[0].message.content)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    info = httpx.get(f"{url}/v1/sessions/{sid}").json()
    assert info["length"] > 0 and info["resident"] and info["bytes"] > 0
    assert httpx.delete(f"{url}/v1/sessions/{sid}").json()["deleted"]
    assert httpx.get(f"{url}/v1/sessions/{sid}").status_code == 404
    assert sid not in REGISTRY


def test_rewind_then_continue_equals_fresh_session(fast_server):
    url = fast_server.url
    a = httpx.post(url + "/v1/sessions", json={"sizing": "static", "capacity": 256}).json()
    assert (a["capacity"], a["sizing"]) == (256, "static")
    gen(url, "My favourite animal is the", 8, session=a["id"])
    history = httpx.get(f"{url}/v1/sessions/{a['id']}").json()["length"]
    gen(url, " and also the", 6, session=a["id"])
    r = httpx.post(f"{url}/v1/sessions/{a['id']}/rewind", json={"length": history})
    assert r.status_code == 200 and r.json()["length"] == history
    continued = gen(url, " but I also like", 10, session=a["id"])
    # the fresh session gets the same history: the first prompt and the same 8 greedy tokens
    b = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    gen(url, "My favourite animal is the", 8, session=b)
    assert gen(url, " but I also like", 10, session=b) == continued
    assert httpx.post(f"{url}/v1/sessions/{b}/rewind", json={"length": 10**6}).status_code == 400
    for sid in (a["id"], b):
        httpx.delete(f"{url}/v1/sessions/{sid}")


def test_stop_strings_are_not_emitted_or_leaked(fast_server):
    url = fast_server.url
    prompt = "Count: one, two, three, four, five, six,"
    full, _ = gen(url, prompt, 16)
    # a stop string spanning token boundaries, taken from the real continuation
    stop = full[6:14]
    assert stop.strip() and stop in full
    expected = full[: full.index(stop)]
    text, _ = gen(url, prompt, 16, stop=[stop])
    assert text == expected
    streamed, final = "", None
    with httpx.stream("POST", url + "/generate_stream", json={"inputs": prompt, "parameters": {"max_new_tokens": 16, "stop": [stop]}}) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                streamed += event["token"]["text"]
                final = event
    assert streamed == expected and final["generated_text"] == expected
    assert final["details"]["finish_reason"] == "stop_sequence"
    assert stop not in streamed


def test_a_stop_string_leaves_the_session_exactly_at_the_stop(fast_server):
    # Stop strings are matched by the handler's output stream, off the model thread, which may sample a
    # token past the stop (or end the reply by max_new_tokens) before the stream sees it: the session
    # must still hold the history up to the stop, and continue from there as if nothing else was sampled.
    url = fast_server.url
    prompt = "Count: one, two, three, four, five, six,"
    r = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 12, "details": True}}, timeout=120).json()
    pieces = [t["text"] for t in r["details"]["tokens"]]
    checked = 0
    for k in range(3, 12):
        stop = pieces[k - 2] + pieces[k - 1]  # completes at token k, if it is not found earlier
        if checked == 3 or not stop.strip() or "".join(pieces[:k]).find(stop) != len("".join(pieces[: k - 2])):
            continue
        plain, cut = (httpx.post(url + "/v1/sessions", json={}).json()["id"] for _ in range(2))
        gen(url, prompt, k, session=plain)
        body = {"inputs": prompt, "session_id": cut, "parameters": {"max_new_tokens": k + 1, "details": True, "stop": [stop]}}
        out = httpx.post(url + "/generate", json=body, timeout=120).json()
        assert out["details"]["finish_reason"] == "stop_sequence" and out["details"]["generated_tokens"] == k
        assert out["generated_text"] == "".join(pieces[: k - 2])
        lengths = [httpx.get(f"{url}/v1/sessions/{sid}").json()["length"] for sid in (plain, cut)]
        assert lengths[0] == lengths[1]
        assert gen(url, " and then", 6, session=cut) == gen(url, " and then", 6, session=plain)
        for sid in (plain, cut):
            httpx.delete(f"{url}/v1/sessions/{sid}")
        checked += 1
    assert checked >= 3


def test_a_stop_seen_after_the_engine_ended_still_cuts_the_session(fast_server):
    # The other side of the race: the engine ends the reply (max_tokens) before the output stream has
    # read the token that completes the stop string, so the cut is made on the idle session.
    engine, url = fast_server.engine, fast_server.url
    prompt = "Count: one, two, three, four, five, six,"
    r = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {"max_new_tokens": 8, "details": True}}, timeout=120).json()
    pieces = [t["text"] for t in r["details"]["tokens"]]
    k = next(k for k in range(3, 8) if pieces[k - 1].strip() and "".join(pieces[:k]).find(pieces[k - 1]) == len("".join(pieces[: k - 1])))
    session = engine.create_session(None, None, None)
    plain = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    gen(url, prompt, k, session=plain)
    req = engine.submit(session, engine.tokenizer.encode(prompt), SamplingParams(max_tokens=8, temperature=0.0, stop=(pieces[k - 1],)),
                        resend=False)
    deadline = time.monotonic() + 60
    while req.events.qsize() < 8 and time.monotonic() < deadline:  # 7 tokens, then the end with the 8th: all handed over
        time.sleep(0.01)
    assert req.finished is not None and req.finished.reason == "length" and session.busy is None
    output = output_stream(engine, req)
    rendered = [output.render(req.events.get_nowait()) for _ in range(8)]
    end = next(e for e in rendered if isinstance(e, Finished))
    assert (end.reason, end.completion_tokens, end.output) == ("stop", k, "".join(pieces[: k - 1]))
    assert len(session.tokens) == httpx.get(f"{url}/v1/sessions/{plain}").json()["length"]
    assert gen(url, " and then", 6, session=session.id) == gen(url, " and then", 6, session=plain)
    for sid in (plain, session.id):
        httpx.delete(f"{url}/v1/sessions/{sid}")


def test_seed_is_reproducible_alone_and_in_a_batch(smollm_server):
    # exact weights: batched and alone must agree bit for bit, which q4's kernels promise only up to float order
    c = client(smollm_server)
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, top_p=0.95, seed=1234)
    alone = [c.completions.create(**kw).choices[0].text for _ in range(2)]
    assert alone[0] == alone[1]
    other = c.completions.create(**{**kw, "seed": 99}).choices[0].text
    assert other != alone[0]

    async def batch():
        ac = openai.AsyncOpenAI(base_url=smollm_server.url + "/v1", api_key="none")
        others = [ac.completions.create(**{**kw, "prompt": f"Story {i}:", "seed": i}) for i in range(6)]
        results = await asyncio.gather(ac.completions.create(**kw), *others)
        return results[0].choices[0].text

    assert asyncio.run(batch()) == alone[0]


def test_disconnect_mid_stream_frees_the_temporary_session(fast_server):
    url, engine = fast_server.url, fast_server.engine
    with httpx.stream("POST", url + "/generate_stream", json={"inputs": "Tell me a long story", "parameters": {"max_new_tokens": 200}}) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
        assert got
    deadline = time.time() + 5
    while time.time() < deadline and (any(not s.persistent for s in engine.sessions) or engine.scheduler.has_work()):
        time.sleep(0.05)
    assert not engine.scheduler.has_work()
    assert not [s for s in engine.sessions if not s.persistent]
    persistent = {s.id for s in engine.sessions if s.persistent}
    assert set(REGISTRY.keys()) <= persistent


def test_tokenize_detokenize_health_metrics(fast_server):
    url = fast_server.url
    r = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["count"] == len(r["tokens"]) == 2
    assert httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "Hello world"
    assert httpx.post(url + "/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert httpx.get(url + "/health").json()["status"] == "ok"
    text = httpx.get(url + "/metrics").text
    for name in ("kvserve:time_to_first_token_seconds_bucket", "kvserve:time_per_output_token_seconds_bucket",
                 "kvserve:e2e_request_latency_seconds_bucket", "kvserve:request_queue_time_seconds_bucket",
                 "kvserve:num_requests_running", "kvserve:num_requests_waiting", "kvserve:kv_cache_usage_perc",
                 "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total", "kvserve:step_num_sessions_bucket"):
        assert name in text, name


def test_default_weights_server_streams_the_fast_models_greedy_tokens(fast_server):
    """The served default (q4 weights where the kernels build, float16 KV beside them) over HTTP gives
    the tokens of the same model decoding alone in process (on this thread, beside the server's)."""
    fast = fast_server.engine.model
    assert fast.weights == resolve_weights(DEFAULT_WEIGHTS)
    want = greedy_alone(fast, "The three laws of thermodynamics state that", 24)
    if fast.weights != "f32":
        assert fast_server.engine.pool.layout.dtype == torch.float16
    body = {"inputs": "The three laws of thermodynamics state that",
            "parameters": {"max_new_tokens": 24, "details": True, "stop": []}, "stream": True}
    ids = []
    with httpx.stream("POST", fast_server.url + "/generate_stream", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                ids.append(json.loads(line[5:])["token"]["id"])
    assert ids == want


def test_an_eos_token_finishes_as_eos_token_on_tgi_and_stop_on_openai(fast_server):
    url = fast_server.url
    prompt = "<|im_start|>user\nReply with one word: yes or no. Is water wet?<|im_end|>\n<|im_start|>assistant\n"
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 64, "details": True}}
    out = httpx.post(url + "/generate", json=body, timeout=60).json()
    details = out["details"]
    assert details["finish_reason"] == "eos_token" and details["generated_tokens"] < 64
    with httpx.stream("POST", url + "/generate_stream", json=body, timeout=60) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1]["details"]["finish_reason"] == "eos_token"
    stopped = httpx.post(url + "/generate", json={"inputs": prompt, "parameters": {
        "max_new_tokens": 64, "details": True, "stop": [out["generated_text"].strip()[:1]]}}, timeout=60).json()["details"]
    assert stopped["finish_reason"] == "stop_sequence"
    chat = httpx.post(url + "/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}], "max_tokens": 64, "temperature": 0},
        timeout=60).json()
    assert chat["choices"][0]["finish_reason"] == "stop" and chat["usage"]["completion_tokens"] < 64


def test_a_json_body_is_read_whatever_its_content_type(fast_server):
    # as llama-server does: `curl -d` without a header sends application/x-www-form-urlencoded
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    for kind in (None, "application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(fast_server.url + "/generate", content=body, headers={"content-type": kind} if kind else {})
        assert r.status_code == 200 and "generated_text" in r.json(), (kind, r.text)
    r = httpx.post(fast_server.url + "/generate", content="inputs=Hello", headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
