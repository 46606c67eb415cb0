"""/v1/completions with echo and logprobs: the echoed prompt's logprobs, against a plain forward of the model."""
import httpx
import openai
import pytest
import torch

from kvcache import REGISTRY, SessionCache, Sizing
from kvcache.step import ActiveStep
from server.config import EngineConfig
from server.engine.kv_pool import kv_layout
from server.engine.sampling import Sampled, SamplingParams
from server.engine.sequence import Sequence

from .test_scheduler import make, run_step

MODEL = "smollm2-135m-instruct"
# longer than a step's token budget (128), so its prefill runs in chunks and a chunk's last row scores the
# next chunk's first token
TEXT = (
    "The Industrial Revolution began in Great Britain in the late eighteenth century. New machines, powered "
    "first by water and then by steam, changed how goods were made. Factories grew in towns, and many people "
    "moved from the countryside to work in them. Railways and canals carried coal, iron and cotton across the "
    "country, and trade with other nations increased quickly. Cities such as Manchester and Birmingham became "
    "centres of industry, while new ideas about work, wages and the rights of workers spread through Europe. "
    "By the middle of the nineteenth century, the steam locomotive had made travel faster than ever before, "
    "and the telegraph let news cross a country in minutes rather than days. Not everyone gained: many "
    "workers lived in crowded housing, and children often worked long hours in mills and mines."
)
SHORT = "The capital of France is"
TOL = 1e-3  # chunked prefill against one whole forward over the same KV dtype: the same sums in another grouping


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def reference(model, ids: list[int], k: int) -> tuple[list[float], list[list[float]]]:
    """Each token's logprob after those before it, and each row's top-k logprobs, from one whole forward of
    the model the server runs (on the test's thread, while the server is idle)."""
    key = "prompt-logprobs-reference"
    REGISTRY.install(key, SessionCache(kv_layout(model, EngineConfig().kv_dtype, len(ids))))
    try:
        with REGISTRY.active(key), torch.inference_mode():
            logits, _ = model.forward(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(1), torch.arange(len(ids) - 1),
                                      torch.zeros(0, dtype=torch.long))
    finally:
        REGISTRY.uninstall(key)
    logp = logits.log_softmax(-1)  # [len - 1, V]
    chosen = logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return chosen.tolist(), logp.topk(k, dim=-1).values.tolist()


@pytest.fixture(scope="module")
def expected(fast_server, served_model):
    ids = served_model.tokenizer.encode(TEXT)
    assert len(ids) > 128
    return ids, *reference(served_model, ids, 3)


def assert_prompt_part(lp, tok, ids, chosen, tops, k=3):
    n = len(ids)
    assert lp.tokens[:n] == [tok.decode([t], skip_special=False) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(chosen, abs=TOL)
    for got, want in zip(lp.top_logprobs[1:n], tops):
        assert len(got) == k and sorted(got.values(), reverse=True) == pytest.approx(want, abs=TOL)
    lengths = [len(t) for t in lp.tokens]
    assert lp.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]


def test_scoring_a_text_equals_a_plain_forward_and_skips_the_prefix_cache(fast_server, served_model, expected):
    ids, chosen, tops = expected
    c, tok = client(fast_server), served_model.tokenizer
    plain = c.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0)  # its blocks stay cached
    again = c.completions.create(model=MODEL, prompt=TEXT, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    scored = [c.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=3) for _ in range(2)]
    for resp in scored:
        choice = resp.choices[0]
        assert choice.text == TEXT and choice.finish_reason == "length"
        assert len(choice.logprobs.tokens) == len(ids)
        assert_prompt_part(choice.logprobs, tok, ids, chosen, tops)
        # every prompt token ran again, though the cache held most of them
        assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
    assert scored[1].choices[0].logprobs.token_logprobs == scored[0].choices[0].logprobs.token_logprobs
    assert plain.choices[0].logprobs is None


def test_echo_with_a_reply_puts_the_prompt_first_and_the_reply_as_without_echo(fast_server, served_model, expected):
    ids, chosen, tops = expected
    c, tok = client(fast_server), served_model.tokenizer
    alone = c.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0, logprobs=2).choices[0]
    both = c.completions.create(model=MODEL, prompt=TEXT, max_tokens=6, temperature=0, logprobs=2, echo=True).choices[0]
    assert both.text == TEXT + alone.text
    assert_prompt_part(both.logprobs, tok, ids, chosen, [t[:2] for t in tops], k=2)
    n = len(ids)
    assert len(alone.logprobs.tokens) == 6 and both.logprobs.tokens[n:] == alone.logprobs.tokens
    assert both.logprobs.token_logprobs[n:] == pytest.approx(alone.logprobs.token_logprobs, abs=1e-4)
    assert [set(t) for t in both.logprobs.top_logprobs[n:]] == [set(t) for t in alone.logprobs.top_logprobs]
    lengths = [len(t) for t in both.logprobs.tokens]
    assert both.logprobs.text_offset == [sum(lengths[:i]) for i in range(len(lengths))]
    # without echo only the reply has logprobs; echo alone has none
    assert alone.logprobs.text_offset[0] == 0
    assert c.completions.create(model=MODEL, prompt=SHORT, max_tokens=2, echo=True).choices[0].logprobs is None


def test_streamed_prompt_logprobs_come_in_the_first_chunk(fast_server, served_model, expected):
    ids, chosen, tops = expected
    c, tok = client(fast_server), served_model.tokenizer
    for max_tokens in (0, 4):
        chunks = [ch for ch in c.completions.create(model=MODEL, prompt=TEXT, max_tokens=max_tokens, temperature=0,
                                                     echo=True, logprobs=3, stream=True) if ch.choices]
        first = chunks[0].choices[0]
        assert first.text == TEXT and first.finish_reason is None
        assert len(first.logprobs.tokens) == len(ids)
        assert_prompt_part(first.logprobs, tok, ids, chosen, tops)
        rest = [ch.choices[0] for ch in chunks[1:]]
        assert sum(len(r.logprobs.tokens) for r in rest if r.logprobs is not None) == max_tokens
        assert rest[-1].finish_reason == "length"


def test_every_choice_and_prompt_gets_its_own_prompt_logprobs(fast_server, served_model):
    c, tok = client(fast_server), served_model.tokenizer
    prompts = [SHORT, "def fibonacci(n):"]
    refs = [reference(served_model, tok.encode(p), 1) for p in prompts]
    resp = c.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=3, temperature=1.0, seed=5,
                                echo=True, logprobs=1)
    assert len(resp.choices) == 4
    for choice in resp.choices:
        ids = tok.encode(prompts[choice.index // 2])
        chosen, tops = refs[choice.index // 2]
        assert choice.text.startswith(prompts[choice.index // 2])
        assert len(choice.logprobs.tokens) == len(ids) + 3
        assert_prompt_part(choice.logprobs, tok, ids, chosen, tops, k=1)


def test_a_session_s_kept_history_is_scored_too(fast_server, served_model, expected):
    ids, chosen, tops = expected
    c, tok = client(fast_server), served_model.tokenizer
    sid = httpx.post(fast_server.url + "/v1/sessions", json={}).json()["id"]
    try:
        first = c.completions.create(model=MODEL, prompt=TEXT, max_tokens=2, temperature=0, extra_body={"session_id": sid})
        assert first.usage.prompt_tokens == len(ids)
        # the whole conversation again: the session keeps TEXT's KV, which has no logits to give
        resp = c.completions.create(model=MODEL, prompt=TEXT, max_tokens=0, echo=True, logprobs=3,
                                    extra_body={"session_id": sid})
        assert resp.usage.prompt_tokens_details.cached_tokens == 0
        assert_prompt_part(resp.choices[0].logprobs, tok, ids, chosen, tops)
    finally:
        httpx.delete(f"{fast_server.url}/v1/sessions/{sid}")


def test_chat_logprobs_stay_the_reply_s(fast_server):
    resp = client(fast_server).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SHORT}], max_tokens=3, temperature=0, logprobs=True,
        top_logprobs=2)
    assert len(resp.choices[0].logprobs.content) == resp.usage.completion_tokens == 3


# ---- the scheduler's side, with real caches and no model --------------------------------------------------


def submit(sched, sessions, prompt, prompt_logprobs=None, max_tokens=1):
    s = sessions.create(64, Sizing.DYNAMIC, persistent=False, owner=None)
    s.tokens.extend(prompt)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, prompt_logprobs=prompt_logprobs)
    req = Sequence(s, params, len(prompt), prompt_ids=list(s.tokens))
    sched.add(req)
    return req


def scored_run(sched, batch):
    """run_step, with each scored row's logprob its target's id (what the runner computes, made checkable)."""
    step_rows = [[Sampled(t, -float(t)) for t in c.scored] for c in batch.chunks if c.scored]
    step = ActiveStep([(c.cache, len(c.tokens)) for c in batch.chunks])
    step._next_layer = step.n_layers  # no model: every layer "ran"
    step.commit()
    sched.postprocess(batch, [Sampled(7) for c in batch.chunks if c.sample], step_rows)


def test_scored_chunks_name_each_row_s_next_prompt_token_and_others_none():
    sched, sessions, _ = make(max_batch_tokens=8)
    prompt = list(range(10, 30))  # 20 tokens: chunks of 8, 8 and 4
    plain = submit(sched, sessions, prompt)
    for _ in range(3):
        batch = sched.schedule()
        assert all(c.scored == () for c in batch.chunks)
        run_step(sched, batch)
    assert plain.finished is not None
    # the same prompt again: its full blocks are cached, but a scoring request runs all of it
    req = submit(sched, sessions, prompt, prompt_logprobs=2)
    seen = []
    while req.finished is None:
        batch = sched.schedule()
        seen += [(c.start, len(c.tokens), c.scored, c.scored_top, c.sample) for c in batch.chunks]
        scored_run(sched, batch)
    assert seen == [(0, 8, tuple(prompt[1:9]), 2, False), (8, 8, tuple(prompt[9:17]), 2, False),
                    (16, 4, tuple(prompt[17:20]), 2, True)]
    assert req.cached_tokens == 0
    assert req.prompt_logprobs == [None, *(Sampled(t, -float(t)) for t in prompt[1:])]
    # once scored, a request adds no rows: a third, plain one reuses the cache
    again = submit(sched, sessions, prompt)
    batch = sched.schedule()
    assert [c.scored for c in batch.chunks] == [()] and again.session.cached_length > 0


def test_a_request_preempted_while_scoring_scores_its_whole_prompt_when_it_runs_again():
    # room for 48 tokens: the older request's growth preempts the younger one halfway through its prompt
    sched, sessions, _ = make(budget_tokens=48, max_batch_tokens=8)
    old = submit(sched, sessions, list(range(1, 15)), max_tokens=30)
    young = submit(sched, sessions, list(range(100, 130)), prompt_logprobs=1, max_tokens=2)
    halfway = False
    while sched.has_work():
        scored_run(sched, sched.schedule())
        halfway |= young in sched.waiting and young.scores_prompt and bool(young.scores)
    assert halfway and old.finished.reason == young.finished.reason == "length"
    assert young.prompt_logprobs == [None, *(Sampled(t, -float(t)) for t in range(101, 130))]
