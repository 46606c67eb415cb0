import torch

from server.engine.sampling import SampleRow, SamplingParams, sample
from server.api.stops import StopMatcher


def rows(*params, seed=0):
    return [SampleRow(p, torch.Generator().manual_seed(seed + i)) for i, p in enumerate(params)]


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
    # keep their candidates (padded with -inf beside it): every row draws what it draws alone
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    params = [*[SamplingParams(temperature=0.7, top_k=50)] * 2, SamplingParams(temperature=1.0, top_p=0.9),
              *[SamplingParams(temperature=0.0)] * 2]
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
