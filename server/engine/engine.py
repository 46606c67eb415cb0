"""The engine: one step loop that owns the model, schedules steps and streams results (its session
operations are in server/engine/session_ops.py).

HTTP handlers call `submit` (which only validates and enqueues, under the engine's lock) and then
await the request's events. The step loop runs on the model thread: schedule, run, postprocess, with
no hop to the event loop between steps (a hop costs a noticeable share of a one-stream step); once a
step, it hands the events it produced to the event loop, which stays free to serve HTTP.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from kvcache import REGISTRY, CacheRegistry, Sizing
from models.export import LoadedModel

from ..config import EngineConfig
from ..errors import InvalidRequest, ShuttingDown
from .constraints import Constraint, Grammars
from .kv_pool import KVPool, kv_layout
from .lifetimes import Lifetimes
from .metrics import Metrics, RecentSteps, generated_by_owner
from .model_thread import keep_step_buffers, keep_torch_serial, model_thread
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .drafts import Drafter
from .kv_events import KVEventPublisher
from .sequence import Scheduling, Sequence
from .session import Session, SessionStore, Turn, owner_id
from .session_ops import SessionOps
from .tenants import label_secret

log = logging.getLogger("kvserve.engine")


class Engine(SessionOps):
    """Continuous-batching engine over one exported model."""

    def __init__(self, model: LoadedModel, config: EngineConfig, registry: CacheRegistry = REGISTRY,
                 worker: ThreadPoolExecutor | None = None) -> None:
        c = model.config
        self.model, self.config, self.tokenizer = model, config, model.tokenizer
        layout = kv_layout(model, config.kv_dtype)
        self.pool = KVPool(registry, config.kv_budget, layout, config.shared_prefix_cache)
        self.sessions = SessionStore(config.max_sessions, config.per_key("max_sessions"), config.session_ttl,
                                     config.session_disk_ttl)
        self.max_context = config.context(c.max_context)
        self.lifetimes = Lifetimes(self.sessions, self.pool, self.max_context, c.vocab_size)
        self.instance_id = uuid.uuid4().hex  # this process's boot id: a router and the peers tell it by this
        if config.kv_disk is not None:
            self.pool.open_tier(config.kv_disk, config.kv_disk_budget, model, holder=self.instance_id)
            self.lifetimes.restore(on_request=bool(config.peers))
        self.eos_ids = frozenset(self.tokenizer.eos_ids) | frozenset(c.eos_ids)
        self.scheduler = Scheduler(config, self.pool, self.sessions, self.eos_ids, label_secret(config.kv_disk))
        self.kv_events = None  # the prefix index's changes, for a router (kv_events.py)
        if config.kv_events is not None:
            self.kv_events = KVEventPublisher(config.kv_events, self.pool.blocks.block_size, config.kv_events_replay)
            self.pool.blocks.events = []
            if self.pool.tier is not None:
                self.pool.tier.events = []
        self.runner = ModelRunner(model, registry)  # its grammar masks are computed on a side thread
        keep_step_buffers()
        # warm-up and every step run here; given the executor that loaded the model, torch keeps one thread team
        self._worker = worker or model_thread()
        self._worker.submit(self.runner.warm_up, layout).result()
        self.metrics = Metrics(model.name)
        self.grammars = Grammars(self.tokenizer, self.max_context)
        self.default_capacity = min(config.session_capacity, self.max_context)
        self.accepting = True
        # The scheduler, sessions and pool change on the step loop and in handlers: each side holds this.
        self.lock = threading.Lock()
        self.recent = RecentSteps()
        self._wake = threading.Event()
        self._stopping = False
        self._outbox: list[tuple[asyncio.Queue, object]] = []  # events of the step loop, not yet handed over
        self._loop: asyncio.AbstractEventLoop | None = None
        self._steps: Future | None = None
        self._sweeper: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        keep_torch_serial()  # the event loop's torch work stays off the model thread's cores
        self._loop = asyncio.get_running_loop()
        self._steps = self._worker.submit(self._step_loop)
        self._sweeper = asyncio.ensure_future(self._sweep_loop())

    async def drain(self, timeout: float) -> bool:
        """Refuse new work, wait up to `timeout` s for in-flight requests, then end those left with the reason
        "shutdown"; True if all finished by themselves."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.scheduler.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.scheduler.has_work():
            return True
        # Past the timeout the engine ends what still runs, as a cancel would but under its own reason: each
        # handler then gets a Finished, so its stream ends with its dialect's final event (not a connection
        # cut by uvicorn's task cancellation), and each session is retired, its record persisted, before
        # stop() closes the disk tier.
        with self.lock:
            for req in (*self.scheduler.waiting, *self.scheduler.running):
                self.cancel(req, "shutdown")
        while self.scheduler.has_work():
            await asyncio.sleep(0.05)
        return False

    async def stop(self) -> None:
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        self._wake.set()
        if self._steps is not None:
            await asyncio.wrap_future(self._steps)  # the step in flight, if any, ends first
        with self.lock:
            for session in list(self.sessions):
                self.pool.drop(session)
        if self.pool.tier is not None:
            self.pool.tier.close()  # every block and record handed over is on disk before the process ends
        self._worker.shutdown(wait=True)
        self.runner.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- requests --------------------------------------------------------------------------
    def submit(self, session: Session, prompt: list[int], params: SamplingParams, resend: bool,
               scheduling: Scheduling = Scheduling()) -> Sequence:
        """Validate and enqueue; nothing about the session changes unless the request is accepted.

        resend=True: `prompt` is the whole conversation (OpenAI clients); the session keeps the
        longest common prefix of its history and prefills the rest. resend=False: `prompt` continues
        the session's history."""
        constraint = self.grammars.matcher(params.grammar)
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

    def cancel(self, req: Sequence, reason: str = "cancelled") -> None:
        if req.finished is None and not req.cancelled:
            req.cancelled, req.cancel_reason = True, reason
            self._wake.set()

    def cut(self, req: Sequence, kept: int) -> None:
        """The handle a request's output stream is given: it found a stop string after `kept` tokens. The
        model thread may have sampled a token or two past it meanwhile, or even ended the request; the
        session keeps only the history up to the stop either way."""
        with self.lock:
            self.scheduler.stop(req, kept)
        self._wake.set()

    # ---- the step loop (model thread) ------------------------------------------------------
    def _step_loop(self) -> None:
        while not self._stopping:
            try:
                self._step()
            except Exception:  # a bug outside the model step must not stop serving
                log.exception("step loop error")
                time.sleep(0.05)
            finally:
                self._hand_over()

    def _step(self) -> None:
        with self.lock:
            batch = self.scheduler.schedule()  # the gauges follow at the step's end (_observe_finished)
            if not batch:
                self._wake.clear()
                self._observe_finished()  # requests cancelled while waiting
                waiting = self.scheduler.has_work()  # work that cannot run yet (nothing fits): look again shortly
        if not batch:
            self._hand_over()
            self._wake.wait(0.005 if waiting else None)
            return
        try:
            started = time.perf_counter()
            sampled, scores, hidden = self.runner.run(batch)
            took = time.perf_counter() - started
        except Exception as e:  # one bad step fails its requests, never the server
            log.exception("step failed")
            with self.lock:
                self.scheduler.fail_step(batch, e)
                self._observe_finished()
            return
        with self.lock:
            self.metrics.step_sessions.observe(len(batch.chunks))
            self.scheduler.row_costs.observe(batch, took)
            before = self.scheduler.counts.emitted
            outputs = [(r, len(r.output_ids)) for c in batch.chunks if (r := self.scheduler.by_id.get(c.request_id))]
            self.scheduler.postprocess(batch, sampled, scores, hidden)
            self.recent.record(len(batch.chunks), batch.n_tokens, self.scheduler.counts.emitted - before,
                               generated_by_owner(outputs))
            self._observe_finished()

    def _post(self, queue: asyncio.Queue, event: object) -> None:
        """A request's event, produced on the step loop (under the lock)."""
        self._outbox.append((queue, event))

    def _hand_over(self) -> None:
        """Give the event loop the events since the last hand-over, in one wake-up."""
        with self.lock:
            events, self._outbox = self._outbox, []
        if events and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_put_all, events)
            except RuntimeError:  # the loop has closed: nobody is left to read them
                pass

    def _observe_finished(self) -> None:
        s = self.scheduler
        if self.kv_events is not None:  # on the step loop, which alone sends them
            events, self.pool.blocks.events = self.pool.blocks.events, []
            self.kv_events.publish(events, self.pool.tier.take_events() if self.pool.tier is not None else [])
        self.metrics.observe(s.take_retired(), s.take_counts())
        self.metrics.pool_mismatches(self.pool.blocks.mismatches)
        if self.pool.tier is not None:
            self.metrics.disk(self.pool.tier)
        self._update_gauges()

    def tenant_figures(self) -> dict[str | None, dict]:
        """Every tenant's figures, by owner id (the caller holds the lock)."""
        s = self.scheduler
        return s.tenants.figures(s.running, s.waiting, self.sessions)

    def render_metrics(self) -> bytes:
        with self.lock:
            tenants = self.scheduler.tenants
            self.metrics.tenants((tenants[owner].metric_label, fig) for owner, fig in self.tenant_figures().items())
        return self.metrics.render()

    def _update_gauges(self) -> None:
        blocks = self.pool.blocks
        self.metrics.gauges(self.pool.used(), self.pool.budget, blocks.n_cached() * blocks.block_bytes,
                            len(self.scheduler.running), len(self.scheduler.waiting), len(self.sessions))


def _put_all(events: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)

