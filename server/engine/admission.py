"""The engine's admission of requests: validate a request against its session, the KV budget and its
tenant's quotas, then enqueue it, all under the engine's lock; nothing changes for a request refused.

A mixin of `Engine` (server/engine/engine.py), which owns the attributes used here: `lock`, `config`,
`model`, `sessions`, `pool`, `scheduler`, `grammars`, `accepting`, `max_context`, `_wake`, `_post` and
`_update_gauges`.
"""
from __future__ import annotations

import dataclasses

from kvcache import Sizing

from ..errors import InvalidRequest, ShuttingDown
from .constraints import Constraint
from .drafts import Drafter
from .sampling import SamplingParams
from .sequence import Scheduling, Sequence
from .session import Session, Turn, owner_id


class Admission:
    """How requests enter the engine."""

    def submit(self, session: Session, prompt: list[int], params: SamplingParams, resend: bool,
               scheduling: Scheduling = Scheduling()) -> Sequence:
        """Validate and enqueue; nothing about the session changes unless the request is accepted.

        resend=True: `prompt` is the whole conversation (OpenAI clients); the session keeps the
        longest common prefix of its history and prefills the rest. resend=False: `prompt` continues
        the session's history."""
        constraint = self.grammars.matcher(params.grammar)
        if constraint is not None and params.whole_output and params.max_tokens is not None:
            constraint.check_fits(params.max_tokens)
        with self.lock:
            req = self._submit(session, prompt, params, resend, constraint, scheduling)
        self._wake.set()
        return req

    def _submit(self, session: Session, prompt: list[int], params: SamplingParams, resend: bool,
                constraint: Constraint | None, scheduling: Scheduling, fetch: bool = True,
                pooling: str | None = None) -> Sequence:
        if not self.accepting:
            raise ShuttingDown("server is shutting down")
        self.sessions.check_idle(session)
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        turn = session.resend(prompt) if resend else session.continue_with(prompt)
        params = self._check(session, turn, params)
        self.scheduler.check_room(session.owner)  # a 429 must come before anything about the session changes
        timeout = min((t for t in (scheduling.timeout, self.config.request_timeout) if t is not None), default=None)
        spec = self.config.speculation
        drafts = scheduling.speculative if scheduling.speculative is not None else spec.mode != "off"
        # mirostat's mu moves after every token, so one step cannot sample a row past a draft with the right mu
        drafts = drafts and not params.mirostat
        if scheduling.cache_salt is not None and scheduling.cache_salt != session.salt:
            self.pool.drop(session)  # its KV was read and published under another namespace: recomputed in this one
            session.salt = scheduling.cache_salt
        req = Sequence(session, params, prompt_tokens=turn.prompt_tokens, history_before=list(session.tokens),
                       kept=turn.kept, sink=self._post, constraint=constraint, priority=scheduling.priority, timeout=timeout,
                       drafter=Drafter(spec) if drafts else None, pooling=pooling)
        session.take(turn, generates=params.max_tokens > 0)
        req.prompt_ids = list(session.tokens)
        if req.runs_prompt:  # it runs its whole prompt itself: the kept history's KV holds no logits or hidden states
            session.truncate_cache(req.prompt_start)
        req.fetch = self.pool.prefetch(session) if fetch and not req.runs_prompt else None
        self.scheduler.add(req)
        self._update_gauges()
        return req

    def _check(self, session: Session, turn: Turn, params: SamplingParams) -> SamplingParams:
        """Whether the turn and its reply fit the session and the KV budget -> params with max_tokens resolved:
        a request that names none gets what room its session has left (up to --default-max-tokens)."""
        if turn.length == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(turn.new) > self.config.max_prompt_tokens:
            raise InvalidRequest(f"prompt of {len(turn.new)} tokens exceeds the limit of {self.config.max_prompt_tokens}", param="prompt")
        if params.max_tokens is None:
            room = max(session.capacity - turn.length, 1)
            params = dataclasses.replace(params, max_tokens=min(room, self.config.default_max_tokens or room))
        if turn.length + params.max_tokens > session.capacity:
            raise InvalidRequest(
                f"prompt of {turn.length} tokens plus max_tokens {params.max_tokens} exceeds the session capacity of "
                f"{session.capacity} tokens (context {self.max_context})",
                param="max_tokens",
            )
        need = self.pool.full_bytes(session.capacity if session.sizing is Sizing.STATIC else turn.length + params.max_tokens)
        if need > self.pool.budget:
            raise InvalidRequest(f"this request needs {need} bytes of KV, more than the budget of {self.pool.budget}", param="max_tokens")
        return params

    def submit_temporary(self, prompt: list[int], params: list[SamplingParams], owner: str | None,
                         scheduling: Scheduling = Scheduling(), pooling: str | None = None) -> list[Sequence]:
        """A request on no session: each of its choices runs on a temporary session of its own, sized to
        the context and removed when done. With n > 1 choices the first prefills the prompt and the others
        fork its KV once that is cached (kept out of the queue's way until then). One pass under the lock,
        and a refusal (429) comes before any session is made."""
        if not self.accepting:
            raise ShuttingDown("server is shutting down")
        constraints = [self.grammars.matcher(p.grammar) for p in params]
        for p, constraint in zip(params, constraints):
            if constraint is not None and p.whole_output and p.max_tokens is not None:
                constraint.check_fits(p.max_tokens)
        reqs: list[Sequence] = []
        with self.lock:
            self.scheduler.check_room(owner_id(owner), len(params))
            sessions = [self._new_session(self.max_context, Sizing.DYNAMIC, False, owner, None, scheduling.cache_salt)
                        for _ in params]
            try:
                for session, p, constraint in zip(sessions, params, constraints):
                    # only the first choice reads the prompt back from disk: the others fork its KV
                    req = self._submit(session, prompt, p, True, constraint, scheduling, fetch=not reqs, pooling=pooling)
                    req.parent = reqs[0] if reqs else None
                    reqs.append(req)
            except Exception:  # the same prompt and limits pass for every choice or for none
                assert not reqs, "a later choice failed where the first passed"
                for session in sessions:
                    self.sessions.remove(session)
                raise
        self._wake.set()
        return reqs

    def embed(self, prompt: list[int], owner: str | None, scheduling: Scheduling = Scheduling()) -> Sequence:
        """An embedding: the prompt prefilled whole on a temporary session of the caller's tenant (its quotas and
        429s, its token counter), its chunks in the steps beside everyone's decodes. It generates nothing, and
        finishes with its final normed hidden states pooled (--pooling) and L2-normalized."""
        return self.submit_temporary(prompt, [SamplingParams(max_tokens=0)], owner, scheduling, self.config.pooling)[0]
