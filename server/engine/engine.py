"""The engine: one step loop that owns the model, schedules steps and streams results (its session
operations are in server/engine/session_ops.py, its admission of requests in admission.py).

HTTP handlers call `submit` (which only validates and enqueues, under the engine's lock) and then
await the request's events. The step loop runs on the model thread: schedule, run, postprocess, with
no hop to the event loop between steps (a hop costs a noticeable share of a one-stream step); once a
step, it hands the events it produced to the event loop, which stays free to serve HTTP.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from kvcache import REGISTRY, CacheRegistry
from models.export import LoadedModel

from ..config import EngineConfig
from .constraints import Grammars
from .kv_pool import KVPool, kv_layout
from .lifetimes import Lifetimes
from .metrics import Metrics, RecentSteps, generated_by_owner
from .model_thread import keep_step_buffers, keep_torch_serial, model_thread
from .runner import ModelRunner
from .scheduler import Scheduler
from .kv_events import KVEventPublisher
from .sequence import Finished, Sequence
from .session import SessionStore
from .admission import Admission
from .session_ops import SessionOps
from .tenants import label_secret

log = logging.getLogger("kvserve.engine")


class Engine(SessionOps, Admission):
    """Continuous-batching engine over one exported model."""

    def __init__(self, model: LoadedModel, config: EngineConfig, registry: CacheRegistry = REGISTRY,
                 worker: ThreadPoolExecutor | None = None) -> None:
        c = model.config
        config = config.for_model(c.n_experts)
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
        self.grammars = Grammars(self.tokenizer, self.max_context, config.constraint_timeout, config.mask_timeout)
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
        self.grammars.close()
        if self.kv_events is not None:
            self.kv_events.close()

    # ---- requests (their admission: admission.py) -------------------------------------------
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
            saving, self.scheduler.saving = self.scheduler.saving, {}
        if not events or self._loop is None:
            return
        # A turn's end waits until its session's record is on disk: once a client is answered, a kill -9
        # cannot lose the turn. Nothing follows a Finished in its queue, so the others need not wait.
        now = []
        for item in events:
            saved = saving.get(item[0]) if isinstance(item[1], Finished) else None
            if saved is not None and not saved.done():
                saved.add_done_callback(lambda _, item=item: self._hand([item]))
            else:
                now.append(item)
        if now:
            self._hand(now)

    def _hand(self, events: list[tuple[asyncio.Queue, object]]) -> None:
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
            if self.pool.tier is not None:  # a full disk's writes may have resumed since the last step
                self.metrics.disk(self.pool.tier)
        return self.metrics.render()

    def _update_gauges(self) -> None:
        blocks = self.pool.blocks
        self.metrics.gauges(self.pool.used(), self.pool.budget, blocks.n_cached() * blocks.block_bytes,
                            len(self.scheduler.running), len(self.scheduler.waiting), len(self.sessions))


def _put_all(events: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, event in events:
        queue.put_nowait(event)

