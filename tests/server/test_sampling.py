import math

import torch

from server.engine.mirostat import M, MirostatState, mirostat_weights
from server.engine.sampling import SampleRow, SamplingParams, sample
from server.engine.typical import typical_weights
from server.api.stops import StopMatcher


def rows(*params, seed=0):
    """One row per params, each with its own seeded generator (and mu, for mirostat), as a request's."""
    return [SampleRow(p, torch.Generator().manual_seed(seed + i), mirostat=MirostatState.start(p) if p.mirostat else None)
            for i, p in enumerate(params)]


def test_greedy_topk_topp_minp():
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0, 1.0]] * 4)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_p=0.01),
        SamplingParams(temperature=1.0, min_p=0.99),
    ]
    assert [s.token for s in sample(logits, rows(*params))] == [1, 1, 1, 1]
    wide = SamplingParams(temperature=1.0, top_k=2)
    seen = {sample(logits[:1], rows(wide, seed=i))[0].token for i in range(60)}
    assert seen == {1, 2}


def test_penalties_change_the_choice():
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    base = rows(SamplingParams(temperature=0.0))
    base[0].output_ids = [0]
    assert sample(logits, base)[0].token == 0
    for p in (SamplingParams(temperature=0.0, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, frequency_penalty=0.5),
              SamplingParams(temperature=0.0, presence_penalty=0.5)):
        r = rows(p)
        r[0].output_ids = [0]
        assert sample(logits, r)[0].token == 1


def test_seeded_rows_do_not_depend_on_the_batch():
    # row 2's top-p mass lies past the leading candidates, so it alone is sorted whole; the top-k rows
    # keep their candidates (padded with -inf beside it); typical_p and mirostat rows are drawn each by
    # itself, beside a plain row: every row draws what it draws alone
    torch.manual_seed(0)
    params = [*[SamplingParams(temperature=0.7, top_k=50)] * 2, SamplingParams(temperature=1.0, top_p=0.9),
              *[SamplingParams(temperature=0.0)] * 2, SamplingParams(temperature=0.8, top_k=40, typical_p=0.7),
              SamplingParams(temperature=0.8, typical_p=0.5), SamplingParams(temperature=0.8, mirostat=1),
              SamplingParams(temperature=0.8, mirostat=2, top_k=40), SamplingParams(temperature=0.9)]
    logits = torch.cat([torch.randn(5, 1000), torch.randn(len(params) - 5, 1000)])
    alone = [sample(logits[i : i + 1], rows(p, seed=40 + i))[0].token for i, p in enumerate(params)]
    assert [s.token for s in sample(logits, rows(*params, seed=40))] == alone


def test_logprobs():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    s = sample(logits, rows(SamplingParams(temperature=0.0, logprobs=2)))[0]
    assert s.token == 2 and abs(s.logprob - float(logits.log_softmax(-1)[0, 2])) < 1e-6
    assert [t for t, _ in s.top] == [2, 1]


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(("END", "xyz"))
    out = [m.feed(d) for d in ["hello E", "N", "d wor", "ld x", "yz tail"]]
    assert "".join(out) == "hello ENd world "
    assert m.stopped and out[-1] == ""
    m = StopMatcher(("###",))
    assert m.feed("a#") == "a" and m.feed("#b") == "##b" and m.flush() == ""
    m = StopMatcher(("###",))
    assert m.feed("a##") == "a" and m.flush() == "##"


def test_top_p_reaches_past_the_leading_candidates():
    """With flat logits, top-p 0.5 keeps half the vocabulary, far more than the candidates sorted first."""
    vocab = 4096
    rows = [SampleRow(SamplingParams(temperature=1.0, top_p=0.5), torch.Generator().manual_seed(s)) for s in range(64)]
    drawn = set()
    for _ in range(4):
        drawn.update(s.token for s in sample(torch.zeros(len(rows), vocab), rows))
    assert len(drawn) > 200  # 256 draws over ~2048 kept tokens; the first 256 candidates alone could not give this


def test_the_penalty_window_counts_only_the_last_tokens_of_the_context():
    """llama.cpp's repeat_last_n: a token seen only before the window is not penalized, one inside it is; the
    prompt counts as much as the reply."""
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])

    def choice(**kw):
        r = rows(SamplingParams(temperature=0.0, **kw))
        r[0].prompt_ids, r[0].output_ids = [0, 3, 3], [2]
        return sample(logits, r)[0].token

    for penalty in ({"repetition_penalty": 1.5}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.5}):
        assert choice(penalty_window=3, **penalty) == 0  # 0 lies just before the last 3 tokens
        assert choice(penalty_window=4, **penalty) == 1  # and just inside the last 4
        assert choice(penalty_window=-1, **penalty) == 1  # the whole context
        assert choice(penalty_window=0, **penalty) == 0  # an empty window: no penalties
        assert choice(penalty_window=1, **penalty) == 0  # the reply's last token only
    # without a window, vLLM's rule: repetition over the prompt too, presence and frequency over the reply only
    assert choice(repetition_penalty=1.5) == 1 and choice(presence_penalty=0.5) == 0
    # frequency counts the occurrences inside the window: three 1s cost 0.3, past its 0.25 lead; two, 0.2
    for window, token in ((3, 0), (2, 1)):
        r = rows(SamplingParams(temperature=0.0, frequency_penalty=0.1, penalty_window=window))
        r[0].prompt_ids, r[0].output_ids = [1, 1], [1]
        assert sample(torch.tensor([[2.0, 2.25, 0.0]]), r)[0].token == token


def reference_typical(probs: list[float], p: float) -> set[int]:
    """llama.cpp's typical filter, written out: by |surprisal - entropy|, until the mass passes p."""
    entropy = -sum(q * math.log(q) for q in probs)
    order = sorted(range(len(probs)), key=lambda i: abs(-math.log(probs[i]) - entropy))
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass > p:
            break
    return kept


def test_typical_p_keeps_what_a_reference_computation_keeps():
    probs = [0.30, 0.14, 0.11, 0.09, 0.08, 0.07, 0.06, 0.05, 0.04, 0.03, 0.02, 0.01]
    logits = torch.tensor(probs).log()
    for p in (0.2, 0.5, 0.7, 0.95):
        expected = reference_typical(probs, p)
        w = typical_weights(logits, SamplingParams(typical_p=p))
        assert set(w.nonzero().squeeze(1).tolist()) == expected, p
        assert torch.allclose(w[sorted(expected)], torch.tensor([probs[i] for i in sorted(expected)]) / sum(probs[i] for i in expected))
    assert 0 not in reference_typical(probs, 0.5)  # it may drop the most likely token, which top-p never does
    # top-k first, renormalized (llama.cpp's chain): typical then works on the 4 left
    head = [q / sum(probs[:4]) for q in probs[:4]]
    w = typical_weights(logits, SamplingParams(typical_p=0.5, top_k=4))
    assert set(w.nonzero().squeeze(1).tolist()) == reference_typical(head, 0.5)
    # at least one token, however small p
    assert (typical_weights(logits, SamplingParams(typical_p=0.0)) > 0).sum() == 1
    drawn = {s.token for seed in range(40) for s in sample(logits[None], rows(SamplingParams(temperature=1.0, typical_p=0.5), seed=seed))}
    assert drawn <= reference_typical(probs, 0.5) and len(drawn) > 1


def reference_mirostat_kept(logits: torch.Tensor, version: int, mu: float) -> list[int]:
    """The tokens llama.cpp's mirostat keeps at this mu, written out in float64."""
    probs = logits.double().softmax(0).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    if version == 2:
        return [i for i in order if -math.log2(probs[i]) <= mu] or order[:1]
    pairs = [(math.log((i + 2) / (i + 1)), math.log(probs[order[i]] / probs[order[i + 1]])) for i in range(min(M, len(probs)) - 1)]
    s_hat = sum(t * b for t, b in pairs) / sum(t * t for t, _ in pairs)
    eps = s_hat - 1
    k = ((eps * 2 ** mu) / (1 - len(probs) ** -eps)) ** (1 / s_hat)
    return order[: max(int(k), 1)]


def test_mirostat_keeps_what_mu_allows_and_moves_mu_as_defined():
    torch.manual_seed(1)
    logits = torch.randn(1, 2000) * 2.5
    for version in (1, 2):
        params = SamplingParams(temperature=1.0, mirostat=version, mirostat_tau=5.0, mirostat_eta=0.1)
        r = rows(params, seed=3)
        assert r[0].mirostat.mu == 10.0  # 2 tau
        for _ in range(6):
            mu = r[0].mirostat.mu
            kept = reference_mirostat_kept(logits[0], version, mu)
            w = mirostat_weights(logits[0], params, mu)
            assert set(w.nonzero().squeeze(1).tolist()) == set(kept), (version, mu)
            token = sample(logits, r)[0].token
            assert token in kept
            surprise = -math.log2(float(logits[0].softmax(0)[token]) / float(logits[0].softmax(0)[kept].sum()))
            assert math.isclose(r[0].mirostat.mu, mu - 0.1 * (surprise - 5.0), rel_tol=1e-5)
        # the lower mu, the fewer tokens kept; at the bottom, the most likely alone
        sizes = [int((mirostat_weights(logits[0], params, mu) > 0).sum()) for mu in (12.0, 8.0, 4.0, 0.0)]
        assert sizes[0] > sizes[1] > sizes[2] >= sizes[3] == 1, sizes
        assert mirostat_weights(logits[0], params, 0.0).argmax() == logits[0].argmax()


def test_mirostat_with_a_high_tau_samples_as_plain_sampling_and_stays_greedy_at_temperature_0():
    torch.manual_seed(2)
    logits = torch.randn(8, 3000) * 2
    plain = SamplingParams(temperature=0.9)
    for version in (1, 2):
        wide = SamplingParams(temperature=0.9, mirostat=version, mirostat_tau=100.0)
        for seed in range(8):
            alone = sample(logits[seed : seed + 1], rows(plain, seed=seed))[0].token
            assert sample(logits[seed : seed + 1], rows(wide, seed=seed))[0].token == alone
        greedy = rows(SamplingParams(temperature=0.0, mirostat=version), seed=0)
        assert [sample(logits[i : i + 1], greedy)[0].token for i in range(8)] == logits.argmax(-1).tolist()
        assert greedy[0].mirostat.mu == 10.0  # nothing was drawn, so mu never moved
