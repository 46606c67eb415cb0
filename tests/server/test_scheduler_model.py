"""The scheduler against a plain model of its sessions, explored by a state machine over real caches.

Hypothesis drives random interleavings of what handlers and the step loop do to the scheduler: turns on
persistent sessions (static and dynamic), requests on temporary sessions, steps whose tokens it draws
(an end token among them), cancels, stop strings found downstream, rewinds and deletes of idle sessions,
on a pool small enough that steps evict idle sessions, take back waiting ones' KV and preempt running
ones all the time. After every operation the pool's invariants hold and stay within the budget, and
every idle session's history is what its turns made it. Liveness: whenever work is left, a step runs
something, and at the end every request finishes within a bounded number of steps.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcache import Sizing
from kvcache.step import ActiveStep
from server.errors import Overloaded
from server.engine.sampling import Sampled, SamplingParams
from server.engine.sequence import Sequence

from .test_scheduler import EOS, make

BUDGET = 5 * 16  # five blocks of 16 tokens
TOKENS = st.lists(st.integers(1, 5), min_size=1, max_size=40)  # few ids: histories share prefixes
DRAIN_STEPS = 400


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sched, self.sessions, _ = make(budget_tokens=BUDGET, max_batch_tokens=24, mixed_prefill_tokens=8,
                                            max_running=3, max_queued=6)
        self.history: dict[str, list[int]] = {}  # persistent session id -> what its turns made its history
        self.live: list[Sequence] = []  # requests not yet finished, in submission order

    # ---- helpers ---------------------------------------------------------------------------------
    def _submit(self, session, prompt: list[int], max_tokens: int) -> None:
        """What the engine's submit does, once its checks have passed (the turn and its reply fit)."""
        if len(session.tokens) + len(prompt) + max_tokens > session.capacity:
            return
        try:
            self.sched.check_room(session.owner)
        except Overloaded:
            return
        before = list(session.tokens)
        turn = session.continue_with(prompt)
        session.take(turn, generates=True)
        req = Sequence(session, SamplingParams(max_tokens=max_tokens, temperature=0.0), len(prompt),
                       history_before=before, kept=turn.kept, prompt_ids=list(session.tokens))
        self.sched.add(req)
        self.live.append(req)

    def _idle(self, data):
        idle = [s for s in self.sessions if s.persistent and s.busy is None]
        return data.draw(st.sampled_from(idle)) if idle else None

    def _settle(self) -> None:
        """Finished requests leave the model's live list; a persistent session's history is its last turn's."""
        for req in [r for r in self.live if r.finished is not None]:
            self.live.remove(req)
            assert req.session.tokens == [*req.prompt_ids, *req.output_ids] or req.session.busy is not None
            assert len(req.output_ids) <= req.params.max_tokens
            if req.finished.reason == "length":
                assert len(req.output_ids) == req.params.max_tokens
            if req.session.persistent and req.session.busy is None:
                self.history[req.session.id] = list(req.session.tokens)

    def _step(self, tokens: list[int]) -> bool:
        batch = self.sched.schedule()
        self._settle()  # cancelled ones were reaped
        if not batch:
            assert not self.sched.has_work(), "work is left, but no step runs any of it"
            return False
        step = ActiveStep([(c.cache, len(c.tokens)) for c in batch.chunks])
        step._next_layer = step.n_layers  # no model: every layer "ran"
        step.commit()
        rows = [c for c in batch.chunks if c.sample]
        self.sched.postprocess(batch, [Sampled(tokens[i % len(tokens)]) for i in range(len(rows))])
        self._settle()
        return True

    # ---- rules -----------------------------------------------------------------------------------
    @rule(sizing=st.sampled_from(Sizing), capacity=st.integers(16, 64))
    @precondition(lambda self: sum(s.persistent for s in self.sessions) < 5)
    def new_session(self, sizing, capacity):
        s = self.sessions.create(capacity, sizing, True, None)
        self.history[s.id] = []

    @rule(data=st.data(), prompt=TOKENS, max_tokens=st.integers(1, 6))
    def turn(self, data, prompt, max_tokens):
        s = self._idle(data)
        if s is not None:
            self._submit(s, prompt, max_tokens)

    @rule(prompt=TOKENS, max_tokens=st.integers(1, 6))
    def temporary(self, prompt, max_tokens):
        self._submit(self.sessions.create(64, Sizing.DYNAMIC, False, None), prompt, max_tokens)

    @rule(tokens=st.lists(st.integers(EOS, 5), min_size=1, max_size=4))
    def step(self, tokens):
        self._step(tokens)

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def cancel(self, data):
        data.draw(st.sampled_from(self.live)).cancelled = True

    @rule(data=st.data())
    @precondition(lambda self: any(r.output_ids for r in self.live))
    def stop_string(self, data):
        req = data.draw(st.sampled_from([r for r in self.live if r.output_ids]))
        self.sched.stop(req, data.draw(st.integers(0, len(req.output_ids))))
        self._settle()

    @rule(data=st.data())
    def rewind(self, data):
        s = self._idle(data)
        if s is not None:
            self.sessions.rewind(s, data.draw(st.integers(0, len(s.tokens))))
            self.history[s.id] = list(s.tokens)

    @rule(data=st.data())
    def delete(self, data):
        s = self._idle(data)
        if s is not None:
            self.sched.pool.drop(s)
            self.sessions.remove(s)
            del self.history[s.id]

    # ---- invariants ------------------------------------------------------------------------------
    @invariant()
    def pool_holds(self):
        self.sched.pool.blocks.check()
        assert self.sched.pool.used() <= self.sched.pool.budget

    @invariant()
    def idle_histories_are_their_turns(self):
        for s in self.sessions:
            if s.persistent and s.busy is None:
                assert s.tokens == self.history[s.id]
                assert s.cached_length <= len(s.tokens)

    def teardown(self):
        for _ in range(DRAIN_STEPS):
            if not self._step([1, 2, 3]):
                break
        assert not self.live and not self.sched.has_work(), f"{len(self.live)} requests never finished"
        for s in list(self.sessions):
            self.sched.pool.drop(s)
        self.sched.pool.blocks.check()
        assert sum(self.sched.pool.blocks.refs) == 0 and self.sched.pool.blocks.reserved == 0


def test_the_scheduler_matches_its_model_and_everything_finishes():
    run = settings(max_examples=300, stateful_step_count=40, deadline=None, database=None, derandomize=True,
                   suppress_health_check=list(HealthCheck))
    run(type("SchedulerRun", (SchedulerMachine,), {})).TestCase().runTest()  # a class of its own: settings bind to it
