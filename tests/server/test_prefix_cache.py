"""KV reuse over HTTP on the real model: cached prefixes, session fork, n > 1, and a pool under pressure."""
import asyncio
import secrets

import httpx
import openai
import pytest

from kvcache import BlockPool
from models import load_model
from server.config import EngineConfig
from server.engine.kv_pool import kv_layout

from ..live_server import LiveServer, metric

MODEL = "smollm2-135m-instruct"
WORDS = "river stone cloud lamp garden violin harbor meadow pepper lantern orbit candle".split()


def unique_text(words: int) -> str:
    """A text no other test sends, so its blocks start cold."""
    rng = secrets.SystemRandom()
    return secrets.token_hex(4) + " " + " ".join(rng.choice(WORDS) for _ in range(words))


def greedy(url: str, prompt: str, n: int = 12, **extra) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n,
                                                   "temperature": 0, "ignore_eos": True, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_shared_system_prompt_is_prefilled_once(fast_server):
    url, c = fast_server.url, openai.OpenAI(base_url=fast_server.url + "/v1", api_key="x")
    system = unique_text(480)  # about 500 tokens
    hits_before = metric(url, "kvserve:prefix_cache_hits_total")
    cached = []
    for i in range(8):
        r = c.chat.completions.create(model=MODEL, temperature=0, max_tokens=4, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": f"Question {i}: what is {i} + {i}?"}])
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        assert r.usage.prompt_tokens >= 500
    assert cached[0] < 480 and all(n >= 480 for n in cached[1:]), cached
    assert metric(url, "kvserve:prefix_cache_hits_total") - hits_before >= 7 * 480


def test_greedy_tokens_are_the_same_from_the_cache_prefilled_alone_or_batched(smollm_server):
    # exact weights: q4's kernels change float order with the rows in a step, so equality there is luck
    url = smollm_server.url
    prompt = unique_text(120)
    cold = greedy(url, prompt, logprobs=0)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    warm = greedy(url, prompt, logprobs=0)
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= cold["usage"]["prompt_tokens"] - 16
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]

    async def batch():
        async with httpx.AsyncClient(timeout=120) as client:
            bodies = [{"model": MODEL, "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
                      for p in [prompt] * 4 + [unique_text(40) for _ in range(4)]]
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=b) for b in bodies))

    for r in (await_all := asyncio.run(batch()))[:4]:
        assert r.json()["choices"][0]["text"] == cold["choices"][0]["text"]
    assert all(r.status_code == 200 for r in await_all)


def test_tgi_details_report_the_cached_prompt_tokens(fast_server):
    url = fast_server.url
    prompt = unique_text(60)
    body = {"inputs": prompt, "parameters": {"max_new_tokens": 4, "details": True}}
    first = httpx.post(url + "/generate", json=body, timeout=60).json()["details"]
    second = httpx.post(url + "/generate", json=body, timeout=60).json()["details"]
    assert first["cached_tokens"] == 0 and second["cached_tokens"] >= 48


def test_thirty_two_forks_share_the_parents_blocks(fast_server):
    url, pool = fast_server.url, fast_server.engine.pool
    parent = httpx.post(url + "/v1/sessions", json={"capacity": 1200}).json()["id"]
    r = httpx.post(url + "/generate", json={"inputs": unique_text(1000), "session_id": parent,
                                            "parameters": {"max_new_tokens": 1}}, timeout=120)
    assert r.status_code == 200
    info = httpx.get(f"{url}/v1/sessions/{parent}").json()
    assert info["length"] >= 1000
    before = pool.used()
    forks = [httpx.post(f"{url}/v1/sessions/{parent}/fork").json() for _ in range(32)]
    assert all(f["length"] == info["length"] and f["parent"] == parent for f in forks)
    assert pool.used() == before  # forking copies nothing

    async def extend():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(client.post(url + "/generate", json={
                "inputs": f" fork {i}", "session_id": f["id"],
                "parameters": {"max_new_tokens": 50, "do_sample": True, "seed": i}}) for i, f in enumerate(forks)))

    assert all(r.status_code == 200 for r in asyncio.run(extend()))
    tails = 32 * pool.full_bytes(50 + 16)  # each fork's own tokens, and the partial block it copied
    # what the forks added, against what the pool held after the parent (other tests' cached prefixes included)
    assert pool.used() - before <= tails, (pool.used(), before, tails)
    assert httpx.get(f"{url}/v1/sessions/{parent}").json()["length"] == info["length"]
    for f in forks:
        httpx.delete(f"{url}/v1/sessions/{f['id']}")
    httpx.delete(f"{url}/v1/sessions/{parent}")
    pool.blocks.check()


def test_a_fork_and_its_parent_diverge_without_touching_each_other(smollm_server):
    # exact weights: each side is compared token for token with a request prefilled in other shapes
    url, engine = smollm_server.url, smollm_server.engine

    def gen(sid, text):
        """One turn -> (its text, the tokens it continued from); the reply may end early at EOS."""
        r = httpx.post(url + "/generate", json={"inputs": text, "session_id": sid,
                                                "parameters": {"max_new_tokens": 10, "details": True}}, timeout=60).json()
        tokens = engine.sessions.get(sid, None).tokens
        return r["generated_text"], tokens[: len(tokens) - r["details"]["generated_tokens"]]

    def alone(tokens):
        """Greedy text after `tokens`, computed without any session, ending where the turn could end."""
        return greedy(url, tokens, 10, ignore_eos=False)["choices"][0]["text"]

    parent = httpx.post(url + "/v1/sessions", json={}).json()["id"]
    gen(parent, unique_text(25))
    history = list(engine.sessions.get(parent, None).tokens)
    child = httpx.post(f"{url}/v1/sessions/{parent}/fork").json()["id"]
    assert engine.sessions.get(child, None).tokens == history
    on_child, child_prompt = gen(child, " The weather today is")
    assert engine.sessions.get(parent, None).tokens == history  # the child's turn wrote nothing of the parent's
    on_parent, parent_prompt = gen(parent, " My favourite number is")
    assert child_prompt[: len(history)] == parent_prompt[: len(history)] == history
    assert child_prompt[len(history) :] == engine.tokenizer.encode(" The weather today is")
    assert parent_prompt[len(history) :] == engine.tokenizer.encode(" My favourite number is")
    # each side's KV is its own history's: it continues as a request over those tokens alone does
    assert on_child == alone(child_prompt)
    assert on_parent == alone(parent_prompt)
    assert on_child != on_parent
    for sid in (parent, child):
        httpx.delete(f"{url}/v1/sessions/{sid}")


def test_n_choices_fork_the_prompt_and_reproduce_with_a_seed(smollm_server):
    # exact weights: a q4 row's logits differ in float summation order between batch sizes, which can
    # move a sampled token; on f32 weights a seeded choice is the same whatever else runs beside it
    c = openai.OpenAI(base_url=smollm_server.url + "/v1", api_key="x")
    messages = [{"role": "user", "content": "Write one word about the sea."}]
    more = {"extra_body": {"ignore_eos": True}}
    a = c.chat.completions.create(model=MODEL, messages=messages, n=4, seed=7, temperature=1.0, max_tokens=12, **more)
    b = c.chat.completions.create(model=MODEL, messages=messages, n=4, seed=7, temperature=1.0, max_tokens=12, **more)
    assert [ch.index for ch in a.choices] == [0, 1, 2, 3]
    assert [ch.message.content for ch in a.choices] == [ch.message.content for ch in b.choices]
    assert len({ch.message.content for ch in a.choices}) > 1
    assert a.usage.completion_tokens == 4 * 12  # every choice counts; the prompt counts once
    assert a.usage.prompt_tokens == c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage.prompt_tokens
    stream = c.chat.completions.create(model=MODEL, messages=messages, n=2, seed=7, temperature=1.0, max_tokens=12,
                                       stream=True, **more)
    texts, reasons = ["", ""], [None, None]
    for chunk in stream:
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            reasons[ch.index] = ch.finish_reason or reasons[ch.index]
    assert texts == [ch.message.content for ch in a.choices[:2]] and None not in reasons
    with pytest.raises(openai.BadRequestError, match="session"):
        c.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=4, extra_headers={"X-Session-Id": "x" * 22})


def tight(server):
    """A server on the same model with a KV budget of 24 blocks (384 tokens): eight 100-token requests do
    not fit at once."""
    block_bytes = server.engine.pool.blocks.block_bytes
    tight = LiveServer(server.engine.model, EngineConfig(kv_budget=24 * block_bytes))
    assert tight.engine.pool.blocks.n_blocks == 24
    return tight


@pytest.fixture(scope="module")
def tiny_tight_server(tiny_checkpoints):
    """The tiny model with a KV budget of 24 blocks: 32 streams at once outgrow it."""
    model = load_model(str(tiny_checkpoints["llama"]))
    block_bytes = BlockPool.for_budget(kv_layout(model, "auto"), 2**30).block_bytes
    with LiveServer(model, EngineConfig(kv_budget=24 * block_bytes)) as server:
        assert server.engine.pool.blocks.n_blocks == 24
        yield server


def test_eviction_under_a_small_budget_gives_the_tokens_of_a_large_one(smollm_server):
    # exact weights: preempted and recomputed in other batches, the tokens must match bit for bit
    prompts = [unique_text(70) for _ in range(8)]

    async def run(url):
        async with httpx.AsyncClient(timeout=300) as client:
            rs = await asyncio.gather(*(client.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True}) for p in prompts))
            return [r.json()["choices"][0]["text"] for r in rs]

    want = asyncio.run(run(smollm_server.url))  # the same load on the shared server's large budget
    with tight(smollm_server) as tight_server:
        assert asyncio.run(run(tight_server.url)) == want
        assert metric(tight_server.url, "kvserve:num_preemptions_total") > 0
        tight_server.engine.pool.blocks.check()


@pytest.mark.slow
def test_reference_counts_return_to_zero_after_300_aborted_requests(tiny_tight_server):
    # the pool's bookkeeping does not depend on the model: the tiny one makes the 300 requests cheap
    url, engine = tiny_tight_server.url, tiny_tight_server.engine

    async def abort_one(client, i):
        body = {"model": MODEL, "prompt": f"{i} " + unique_text(20), "max_tokens": 64, "stream": True, "ignore_eos": True}
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    break  # the client goes away after its first event

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            gate = asyncio.Semaphore(32)

            async def guarded(i):
                async with gate:
                    await abort_one(client, i)

            await asyncio.gather(*(guarded(i) for i in range(300)))

    asyncio.run(run())
    for _ in range(200):
        if not engine.scheduler.has_work():
            break
        asyncio.run(asyncio.sleep(0.05))
    with engine.lock:
        blocks = engine.pool.blocks
        blocks.check()
        assert sum(blocks.refs) == 0 and blocks.reserved == 0
        assert blocks.n_free() + blocks.n_cached() == blocks.n_blocks
