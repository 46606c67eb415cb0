"""Embeddings through each dialect's own client: OpenAI's and vLLM's /v1/embeddings, Ollama's /api/embed and
/api/embeddings. The vectors are the model's final normed hidden states pooled and normalized: checked
against the layers run in process, alone and beside a running generation, mean and last-token; and
Ollama's model management routes, which kvserve does not implement, answer in Ollama's error shape."""
import base64
import struct

import httpx
import ollama
import openai
import pytest
import torch

from kvcache import REGISTRY, CacheConfig, CacheRegistry, SessionCache
from kvcache.step import ActiveStep
from models.export import build_model, export_program, runnable_module
from models.gguf_loader import read_gguf
from models.hf_loader import read_hf
from server.cli import _engine_config, build_parser
from server.config import EngineConfig
from server.engine.kv_pool import KVPool
from server.engine.sampling import Sampled, SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.engine.session import SessionStore

from ..live_server import LiveServer

MODEL = "smollm2-135m-instruct"
TEXTS = ["The cat sat on the mat.", "Quarterly revenue grew by twelve percent.", "Le chat est sur le tapis."]
LONG = " ".join(f"Item {i}: a sentence about the weather in city number {i}." for i in range(16))  # ~200 tokens
TOL = 1e-4  # the server's chunked steps against one forward of the same f32 layers


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def vectors(response) -> torch.Tensor:
    return torch.tensor([d.embedding for d in sorted(response.data, key=lambda d: d.index)])


@pytest.fixture(scope="module")
def layers(smollm_path):
    """The f32 model's final normed hidden states of a text's ids, from its layers run here in one forward
    (not the server's program): embed, the decoder blocks over a cache, the final norm."""
    config, state, _ = read_gguf(smollm_path)
    model = build_model(config, state, torch.float32)

    def states(ids: list[int]) -> torch.Tensor:
        key = "embedding-reference"
        REGISTRY.install(key, SessionCache(CacheConfig(config.n_layers, config.n_kv_heads, config.head_dim, len(ids))))
        try:
            with REGISTRY.active(key), torch.inference_mode():
                positions = torch.arange(len(ids)).unsqueeze(1)
                angles = positions.float() * model.inv_freq
                angles = torch.cat((angles, angles), dim=-1)
                x = model.layers(model.embed_tokens(torch.tensor([ids])), positions, angles.cos(), angles.sin())
                return model.norm(x[0]).float()  # [n, dim]
        finally:
            REGISTRY.uninstall(key)

    return states


@pytest.mark.parametrize("weights", ["f32", "f16", "q4"])
@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_every_weight_mode_hands_back_the_hidden_rows_asked_for(tiny_checkpoints, weights, kind):
    """The program's second output: the final norm's output at the rows asked for (none costs nothing and
    changes no logit), the rows its lm_head reads, in every weight mode, with a tied head or its own."""
    config, state, tok = read_hf(tiny_checkpoints[kind], torch.float32)
    model = build_model(config, state, torch.float32, weights)
    program = runnable_module(export_program(model))
    ids = tok.encode(LONG)[:24]
    n = len(ids)

    def run(rows: list[int], hidden: list[int]):
        key = f"hidden-rows-{weights}-{kind}"
        REGISTRY.install(key, SessionCache(CacheConfig(config.n_layers, config.n_kv_heads, config.head_dim, n)))
        try:
            with REGISTRY.active(key), torch.inference_mode():
                return program(torch.tensor([ids]), torch.arange(n).unsqueeze(1), torch.tensor(rows),
                               torch.tensor(hidden, dtype=torch.long))
        finally:
            REGISTRY.uninstall(key)

    logits, hidden = run(list(range(n)), list(range(n)))
    assert hidden.shape == (n, config.dim) and hidden.dtype == torch.float32
    plain, none = run(list(range(n)), [])
    assert none.shape == (0, config.dim) and torch.equal(plain, logits)
    _, some = run([n - 1], [3, 7, n - 1])
    assert torch.equal(some, hidden[[3, 7, n - 1]])
    with torch.inference_mode():
        torch.testing.assert_close(model.lm_head(hidden).float(), logits, atol=1e-4, rtol=0)


def _state(position: int) -> torch.Tensor:
    """What the scheduler test's model hands back for a row: a known vector for each position."""
    return torch.tensor([1.0, position, position % 3, -position / 7])


def _scheduled(pooling: str, budget_tokens: int):
    """A scheduler on real caches and no model, a generation that fills the prefix cache with the tokens an
    embedding then runs, and that embedding -> (scheduler, embedding, the steps' chunks)."""
    layout = CacheConfig(n_layers=2, n_kv_heads=1, head_dim=4, capacity=1)
    config = EngineConfig(kv_budget=budget_tokens * layout.bytes_per_token(), max_batch_tokens=8, pooling=pooling)
    sessions = SessionStore(100)
    sched = Scheduler(config, KVPool(CacheRegistry(), config.kv_budget, layout), sessions, frozenset({0}))

    def submit(n: int, params: SamplingParams, pooling: str | None = None) -> Sequence:
        s = sessions.create(64, "dynamic", persistent=False, owner=None)
        s.tokens.extend(range(1, n + 1))
        req = Sequence(s, params, n, prompt_ids=list(s.tokens), pooling=pooling)
        sched.add(req)
        return req

    generation = submit(18, SamplingParams(max_tokens=16, temperature=0.0))
    embedding = submit(30, SamplingParams(max_tokens=0), pooling)
    chunks = []
    for _ in range(100):
        batch = sched.schedule()
        if not batch:
            break
        step = ActiveStep([(c.cache, len(c.tokens)) for c in batch.chunks])
        step._next_layer = step.n_layers  # no model: every layer "ran"
        step.commit()
        hidden = [torch.stack([_state(c.start + i) for i in range(len(c.tokens) - c.pooled, len(c.tokens))])
                  for c in batch.chunks if c.pooled]
        chunks += [c for c in batch.chunks if c.request_id == embedding.id]
        sched.postprocess(batch, [Sampled(7) for c in batch.chunks if c.sample], [], hidden)
    assert generation.finished.reason == "length" and embedding.finished.reason == "length"
    assert not embedding.output_ids and not any(c.sample for c in chunks)
    return sched, embedding, chunks


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_the_scheduler_pools_an_embedding_over_its_chunks_and_after_a_preemption(pooling):
    """Its chunks ride beside the generation's decodes; it reads nothing from the prefix cache (its first
    chunk starts at 0 though the generation cached those tokens), and a preemption runs it again from
    the start without pooling a row twice."""
    sched, embedding, chunks = _scheduled(pooling, budget_tokens=48)
    assert sched.counts.preemptions == 1 and [c.start for c in chunks].count(0) == 2  # preempted, and ran again
    assert chunks[0].start == 0 and embedding.cached_tokens == 0
    rows = torch.stack([_state(p) for p in range(30)])
    expected = rows.mean(0) if pooling == "mean" else rows[-1]
    assert torch.allclose(embedding.finished.embedding, torch.nn.functional.normalize(expected, dim=0), atol=1e-7)
    if pooling == "last":
        assert [c.pooled for c in chunks if c.pooled] == [1] and chunks[-1].pooled == 1
    else:
        assert all(c.pooled == len(c.tokens) for c in chunks)


def test_vectors_are_unit_rows_of_the_models_width_in_float_and_base64(fast_server):
    c, width = client(fast_server), fast_server.engine.model.config.dim
    floats = c.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == MODEL and [d.index for d in floats.data] == [0, 1, 2]
    v = vectors(floats)
    assert v.shape == (3, width) and torch.allclose(v.norm(dim=-1), torch.ones(3), atol=1e-5)
    assert (v[0] - v[1]).abs().max() > 0.01 and (v[0] - v[2]).abs().max() > 0.01  # different texts, different vectors
    tok = fast_server.engine.tokenizer
    n = sum(len(tok.encode(t)) for t in TEXTS)
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == n
    # the SDK asks for base64 unless told otherwise, and decodes it: the same float32 values
    assert torch.equal(vectors(c.embeddings.create(model=MODEL, input=TEXTS)), v)
    raw = httpx.post(fast_server.url + "/v1/embeddings",
                     json={"model": MODEL, "input": TEXTS[0], "encoding_format": "base64"})
    packed = base64.b64decode(raw.json()["data"][0]["embedding"])
    assert torch.equal(torch.tensor(struct.unpack(f"<{width}f", packed)), v[0])
    # token ids run as sent: a text's ids give the text's vector
    ids = [tok.encode(t) for t in TEXTS]
    assert torch.equal(vectors(c.embeddings.create(model=MODEL, input=ids[0], encoding_format="float"))[0], v[0])
    by_ids = c.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert torch.equal(vectors(by_ids), v) and by_ids.usage.prompt_tokens == n


def test_dimensions_only_the_models_width_and_inputs_that_fit(fast_server):
    c, width = client(fast_server), fast_server.engine.model.config.dim
    assert len(c.embeddings.create(model=MODEL, input="hi", dimensions=width).data[0].embedding) == width
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=MODEL, input="hi", dimensions=64)
    assert e.value.body["param"] == "dimensions" and str(width) in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model=MODEL, input=[1] * (fast_server.engine.max_context + 1))
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError):
        c.embeddings.create(model="text-embedding-3-small", input="hi")
    for bad in ("", [], ["a", ""], [[1, 2], []], [1.5]):
        r = httpx.post(fast_server.url + "/v1/embeddings", json={"model": MODEL, "input": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", bad


def test_a_text_embeds_the_same_alone_and_beside_a_running_generation(fast_server):
    """Beside decodes a step takes at most --mixed-prefill-tokens of a prompt, so the long text is pooled over
    other chunks than alone; its rows' hidden states do not depend on what shares their step."""
    c, url = client(fast_server), fast_server.url
    alone = vectors(c.embeddings.create(model=MODEL, input=LONG, encoding_format="float"))[0]
    again = vectors(c.embeddings.create(model=MODEL, input=LONG, encoding_format="float"))[0]
    assert torch.equal(alone, again)  # its blocks are cached now, but an embedding runs every row itself
    body = {"model": MODEL, "prompt": "Count to a thousand: 1, 2,", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data:"))
        next(lines)  # it decodes
        batched = c.embeddings.create(model=MODEL, input=[TEXTS[0], LONG, TEXTS[1]], encoding_format="float")
        assert next(lines) != "data: [DONE]"  # still decoding: the embeddings ran beside it
    assert (vectors(batched)[1] - alone).abs().max() <= 1e-6


def test_mean_pooling_equals_the_layers_run_in_process(smollm_server, layers):
    tok = smollm_server.engine.tokenizer
    ids = [tok.encode(t) for t in (LONG, TEXTS[0])]
    expected = torch.stack([torch.nn.functional.normalize(layers(i).mean(0), dim=0) for i in ids])
    got = vectors(client(smollm_server).embeddings.create(model=MODEL, input=[LONG, TEXTS[0]], encoding_format="float"))
    assert (got - expected).abs().max() <= TOL


def test_the_pooling_flag_switches_to_the_last_token(smollm, layers):
    args = build_parser().parse_args(["serve", "--pooling", "last"])
    assert _engine_config(args).pooling == "last" and EngineConfig().pooling == "mean"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--pooling", "cls"])
    ids = smollm.tokenizer.encode(LONG)
    states = layers(ids)
    with LiveServer(smollm, _engine_config(args)) as server:
        got = vectors(client(server).embeddings.create(model=MODEL, input=LONG, encoding_format="float"))[0]
        assert ollama.Client(host=server.url).embed(model=MODEL, input=LONG).embeddings[0] == got.tolist()
    assert (got - torch.nn.functional.normalize(states[-1], dim=0)).abs().max() <= TOL
    assert (got - torch.nn.functional.normalize(states.mean(0), dim=0)).abs().max() > 0.01


def test_ollama_embed_and_the_older_embeddings_route(fast_server):
    o, tok = ollama.Client(host=fast_server.url), fast_server.engine.tokenizer
    expected = vectors(client(fast_server).embeddings.create(model=MODEL, input=TEXTS, encoding_format="float"))
    r = o.embed(model=MODEL, input=TEXTS)
    assert r.model == MODEL and torch.equal(torch.tensor(r.embeddings), expected)
    assert r.prompt_eval_count == sum(len(tok.encode(t)) for t in TEXTS)
    assert r.total_duration > 0 and r.load_duration == 0
    one = o.embed(model=MODEL + ":latest", input=TEXTS[0])
    assert len(one.embeddings) == 1 and one.embeddings[0] == expected[0].tolist()
    assert o.embeddings(model=MODEL, prompt=TEXTS[1]).embedding == expected[1].tolist()
    assert o.embed(model=MODEL, input="").embeddings == []  # nothing to embed: the model is loaded
    with pytest.raises(ollama.ResponseError) as e:
        o.embed(model="nomic-embed-text", input="hi")
    assert e.value.status_code == 404 and "nomic-embed-text" in e.value.error


def test_ollama_truncates_to_the_context_unless_told_not_to(fast_server):
    o, url = ollama.Client(host=fast_server.url), fast_server.url
    ids = fast_server.engine.tokenizer.encode(LONG)
    assert len(ids) > 64
    cut = o.embed(model=MODEL, input=LONG, options={"num_ctx": 64})
    assert cut.prompt_eval_count == 64
    first = client(fast_server).embeddings.create(model=MODEL, input=ids[:64], encoding_format="float")
    assert cut.embeddings[0] == first.data[0].embedding
    with pytest.raises(ollama.ResponseError) as e:
        o.embed(model=MODEL, input=LONG, truncate=False, options={"num_ctx": 64})
    assert e.value.status_code == 400 and "context length" in e.value.error
    r = httpx.post(url + "/api/embed", json={"model": MODEL, "input": [1, 2]})
    assert r.status_code == 400 and set(r.json()) == {"error"}  # Ollama's error shape under /api/


def test_an_embedding_is_refused_like_a_generation_when_the_server_is_full(served_model):
    with LiveServer(served_model, EngineConfig(max_running=1, max_queued=1)) as server:
        body = {"model": MODEL, "prompt": "Count: 1, 2,", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as a, \
                httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as b:
            assert a.status_code == b.status_code == 200
            with pytest.raises(openai.RateLimitError):
                client(server).embeddings.create(model=MODEL, input="hi")
            with pytest.raises(ollama.ResponseError) as e:
                ollama.Client(host=server.url).embed(model=MODEL, input="hi")
            assert e.value.status_code == 429 and "full" in e.value.error


def test_ollamas_model_management_routes_say_they_are_not_supported(fast_server, tmp_path):
    o = ollama.Client(host=fast_server.url)
    blob = tmp_path / "blob"
    blob.write_bytes(b"weights")
    calls = {"POST /api/pull": lambda: o.pull(MODEL), "POST /api/push": lambda: o.push(MODEL),
             "POST /api/create": lambda: o.create(model="mine", from_=MODEL),
             "POST /api/copy": lambda: o.copy(MODEL, "mine"), "DELETE /api/delete": lambda: o.delete(MODEL),
             "POST /api/blobs/{digest}": lambda: o.create_blob(blob)}
    for route, call in calls.items():
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501 and e.value.error.startswith(f"{route} is not supported"), route
    r = httpx.head(fast_server.url + "/api/blobs/sha256:" + "0" * 64)
    assert r.status_code == 501
