"""N-gram drafts and their verdicts against real caches, with no model: exact chunks, rows and rewinds."""
from kvcache.step import ActiveStep
from server.engine.drafts import ROW_COST, Drafter, SpeculationConfig, best_length
from server.engine.sampling import Sampled, SamplingParams
from server.engine.sequence import Sequence

from .test_scheduler import make, run_step, submit

CONFIG = SpeculationConfig(max_draft=3, max_n=3, min_n=1)


def confident() -> Drafter:
    d = Drafter(CONFIG)
    d.rate = 0.95  # as after a run of good drafts: it drafts all it may
    return d


def test_lookup_takes_the_longest_suffix_at_its_latest_occurrence():
    d = confident()
    #          0  1  2  3  4  5  6  7  8  9 10
    history = [5, 6, 7, 1, 5, 6, 8, 9, 2, 5, 6]
    # the suffix [5, 6] occurred at 0..1 (then 7) and at 4..5 (then 8): the latest wins
    assert d.propose(history, 3) == [8, 9, 2]
    # [2, 5, 6] never occurred before, [5, 6] did: the longest that occurred is used, capped by the limit
    assert d.propose([*history, 8], 2) == [9, 2]
    assert confident().propose([1, 2, 3, 4], 3) == []  # no suffix occurred before
    assert confident().propose([1, 2, 1], 0) == []


def test_drafts_pay_only_at_a_good_acceptance_rate_and_a_bad_one_waits():
    assert best_length(0.95, 5) == 5 and best_length(0.05, 5) == 0
    assert best_length(0.6, 5) <= best_length(0.8, 5)
    d = Drafter(CONFIG)
    history = [1, 2, 3, 1, 2, 3, 1, 2]
    assert d.propose(history, 3)  # it starts hopeful
    for _ in range(3):
        d.record(3, 0)
    assert d.propose(history, 3) == []  # rejected every time: it waits
    waits = 1
    while not d.propose(history, 3):
        waits += 1
    assert waits >= 8  # and then tries again


def drafting(sched, sessions, history, max_tokens=10):
    s = sessions.create(64, "dynamic", persistent=False, owner=None)
    s.tokens.extend(history)
    req = Sequence(s, SamplingParams(max_tokens=max_tokens, temperature=0.0), len(history), prompt_ids=list(history),
                   drafter=confident())
    sched.add(req)
    return req


def run(sched, batch, sampled: list[int]):
    step = ActiveStep([(c.cache, len(c.tokens)) for c in batch.chunks])
    step._next_layer = step.n_layers  # no model: every layer "ran"
    step.commit()
    assert len(sampled) == len(batch.rows)
    sched.postprocess(batch, [Sampled(t) for t in sampled])


def test_a_drafted_step_keeps_the_drafts_that_match_and_rewinds_the_rest():
    sched, sessions, _ = make()
    req = drafting(sched, sessions, [4, 5, 6, 7, 4, 5])
    run(sched, sched.schedule(), [6])  # the prompt, and its first token: the suffix [4, 5, 6] occurred before, then 7, 4, 5
    assert req.output_ids == [6] and req.session.cached_length == 6
    batch = sched.schedule()
    (chunk,) = batch.chunks
    assert chunk.tokens == (6, 7, 4, 5) and chunk.drafts == 3 and chunk.start == 6
    assert [r.output_ids for r in batch.rows] == [[6], [6, 7], [6, 7, 4], [6, 7, 4, 5]]  # each row past the drafts before it
    run(sched, batch, [7, 4, 8, 3])  # 7 and 4 stand, 8 is where it parts from the drafts (3 is past it)
    assert req.output_ids == [6, 7, 4, 8]
    assert req.session.tokens == [4, 5, 6, 7, 4, 5, 6, 7, 4, 8]
    assert req.session.cached_length == 9  # KV for the pending 6 and the drafts 7, 4 kept; 8 is pending
    assert sched.counts.draft_tokens == 3 and sched.counts.accepted_tokens == 2 and sched.counts.emitted == 4
    sched.pool.blocks.check()


def test_drafts_stop_at_max_tokens_and_an_end_token_rewinds_the_kv_past_it():
    sched, sessions, _ = make()
    req = drafting(sched, sessions, [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=3)
    run(sched, sched.schedule(), [3])
    batch = sched.schedule()
    assert batch.chunks[0].drafts == 1  # 3 tokens at most: one emitted, this row's, and one draft
    run(sched, batch, [1, 5])  # the draft stands, and the row after it makes the third token
    assert req.finished is not None and req.finished.reason == "length" and req.output_ids == [3, 1, 5]

    req = drafting(sched, sessions, [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=10)
    run(sched, sched.schedule(), [3])
    batch = sched.schedule()
    assert batch.chunks[0].drafts == 3
    run(sched, batch, [1, 0, 3, 1])  # a draft stands, then EOS ends it before the rest
    assert req.finished.reason == "eos" and req.output_ids == [3, 1, 0]
    assert sched.pool.blocks.n_used() == 0  # the temporary session went, every draft block with it
    sched.pool.blocks.check()


def test_many_decoding_requests_draft_nothing():
    sched, sessions, _ = make()
    reqs = [drafting(sched, sessions, [1, 2, 3, 1, 2, 3, 1, 2]) for _ in range(8)]  # max_rows 8: no spare rows
    run(sched, sched.schedule(), [3] * 8)
    batch = sched.schedule()
    assert [c.drafts for c in batch.chunks] == [0] * 8 and len(batch.rows) == 8
    assert all(r.output_ids == [3] for r in reqs)


def test_a_draft_row_costs_what_the_timed_steps_say():
    sched, sessions, _ = make()
    costs = sched.row_costs
    plain = submit(sched, sessions, 4, max_tokens=2)
    prefill = sched.schedule()
    costs.observe(prefill, 1.0)  # a prompt's step says nothing of what a draft row costs
    run_step(sched, prefill)
    assert costs.row_cost() == ROW_COST  # nothing measured yet: the prior
    one_row = sched.schedule()
    assert one_row.n_tokens == 1
    costs.observe(one_row, 0.010)
    run_step(sched, one_row)
    assert plain.finished is not None and costs.row_cost() == ROW_COST  # one row alone gives no slope

    req = drafting(sched, sessions, [4, 5, 6, 7, 4, 5])
    run(sched, sched.schedule(), [6])
    drafted = sched.schedule()
    assert drafted.n_tokens == 4 and drafted.chunks[0].drafts == 3
    costs.observe(drafted, 0.0115)  # three draft rows cost 15% of a one-row step
    assert abs(costs.row_cost() - 0.05) < 1e-9
    costs.observe(drafted, 0.0165)  # each new step moves the average a fifth of the way
    assert abs(costs.row_cost() - (0.0125 - 0.010) / 3 / 0.010) < 1e-9
    # where rows are cheap, the same acceptance pays for longer drafts
    assert best_length(0.7, 7, costs.row_cost()) > best_length(0.7, 7)
    assert req.output_ids == [6]
