"""The engine: one asyncio task that owns the model, schedules steps and streams results.

HTTP handlers call `submit` (which only validates and enqueues) and then await the request's events.
The model runs in one dedicated worker thread so the event loop stays responsive during a step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvcache import REGISTRY, CacheConfig, CacheRegistry, Sizing
from models.export import LoadedModel

from .config import EngineConfig
from .errors import InvalidRequest, ShuttingDown
from .kv_pool import KVPool
from .metrics import Metrics
from .model_thread import keep_step_buffers, keep_torch_serial, model_thread, submit_started
from .runner import ModelRunner
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Request
from .session import Session, SessionStore

log = logging.getLogger("kvserve.engine")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Engine:
    """Continuous-batching engine over one exported model."""

    def __init__(self, model: LoadedModel, config: EngineConfig, registry: CacheRegistry = REGISTRY,
                 worker: ThreadPoolExecutor | None = None) -> None:
        c = model.config
        self.model, self.config, self.tokenizer = model, config, model.tokenizer
        layout = CacheConfig(c.n_layers, c.n_kv_heads, c.head_dim, capacity=1, dtype=kv_dtype(config, model))
        self.pool = KVPool(registry, config.kv_budget, layout)
        self.sessions = SessionStore(config.max_sessions)
        self.eos_ids = frozenset(self.tokenizer.eos_ids) | frozenset(c.eos_ids)
        self.scheduler = Scheduler(config, self.pool, self.sessions, self.eos_ids)
        self.runner = ModelRunner(model, registry)
        keep_step_buffers()
        # warm-up and every step run here; given the executor that loaded the model, torch keeps one thread team
        self._worker = worker or model_thread()
        self._worker.submit(self.runner.warm_up, layout).result()
        self.metrics = Metrics(model.name)
        self.default_capacity = min(config.session_capacity, c.max_context)
        self.accepting = True
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        keep_torch_serial()  # the event loop's torch work stays off the model thread's cores
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="kvserve-engine")

    async def drain(self, timeout: float) -> bool:
        """Refuse new work, then wait up to `timeout` s for in-flight requests; True if all finished."""
        self.accepting = False
        deadline = time.monotonic() + timeout
        while self.scheduler.has_work() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.scheduler.has_work()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for session in list(self.sessions):
            self.pool.drop(session)
        self._worker.shutdown(wait=True)

    # ---- sessions --------------------------------------------------------------------------
    def create_session(
        self, capacity: int | None, sizing: str | None, owner: str | None, persistent: bool = True, session_id: str | None = None
    ) -> Session:
        if not self.accepting:
            raise ShuttingDown("server is shutting down")
        capacity = self.default_capacity if capacity is None else capacity
        if capacity > self.model.config.max_context:
            raise InvalidRequest(
                f"capacity {capacity} exceeds the model's context of {self.model.config.max_context} tokens", param="capacity"
            )
        sizing = Sizing(sizing) if sizing is not None else self.config.session_sizing
        if sizing is Sizing.STATIC and self.pool.full_bytes(capacity) > self.pool.budget:
            raise InvalidRequest(
                f"a static session of {capacity} tokens needs {self.pool.full_bytes(capacity)} bytes, "
                f"more than the whole KV budget of {self.pool.budget} bytes",
                param="capacity",
            )
        session = self.sessions.create(capacity, sizing, persistent, owner, session_id)
        self.metrics.sessions.set(len(self.sessions))
        return session

    def delete_session(self, session: Session) -> None:
        self.sessions.check_idle(session)
        self.pool.drop(session)
        self.sessions.remove(session)
        self.metrics.sessions.set(len(self.sessions))

    def rewind_session(self, session: Session, length: int) -> None:
        self.sessions.check_idle(session)
        if not 0 <= length <= len(session.tokens):
            raise InvalidRequest(f"length must be between 0 and the session's length {len(session.tokens)}", param="length")
        session.truncate(length)

    # ---- requests --------------------------------------------------------------------------
    def submit(
        self,
        session: Session,
        prompt: list[int],
        params: SamplingParams,
        resend: bool,
        max_tokens_given: bool = True,
        inject_fault: bool = False,
    ) -> Request:
        """Validate and enqueue; nothing about the session changes unless the request is accepted.

        resend=True: `prompt` is the whole conversation (OpenAI clients); the session keeps the
        longest common prefix of its history and prefills the rest. resend=False: `prompt` continues
        the session's history.
        """
        if not self.accepting:
            raise ShuttingDown("server is shutting down")
        self.sessions.check_idle(session)
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt")
        keep = common_prefix(session.tokens, prompt) if resend else len(session.tokens)
        new = prompt[keep:] if resend else prompt
        total = keep + len(new)
        if total == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(new) > self.config.max_prompt_tokens:
            raise InvalidRequest(f"prompt of {len(new)} tokens exceeds the limit of {self.config.max_prompt_tokens}", param="prompt")
        room = session.capacity - total
        if not max_tokens_given:
            params = _with_max_tokens(params, min(params.max_tokens, max(room, 1)))
        if total + params.max_tokens > session.capacity:
            raise InvalidRequest(
                f"prompt of {total} tokens plus max_tokens {params.max_tokens} exceeds the session capacity of "
                f"{session.capacity} tokens (model context {self.model.config.max_context})",
                param="max_tokens",
            )
        need = self.pool.full_bytes(session.capacity if session.sizing is Sizing.STATIC else total + params.max_tokens)
        if need > self.pool.budget:
            raise InvalidRequest(f"this request needs {need} bytes of KV, more than the budget of {self.pool.budget}", param="max_tokens")
        self.scheduler.check_room()  # a 429 must come before anything about the session changes
        reused = min(keep, session.cached_length)
        req = Request(session, params, self.tokenizer, prompt_tokens=len(prompt) if resend else len(new),
                      cached_tokens=reused if resend else 0, inject_fault=inject_fault,
                      history_before=list(session.tokens), kept=keep)
        session.truncate(keep)
        session.tokens.extend(new)
        if not session.pending and params.max_tokens > 0 and session.cache is not None:
            session.cache.rewind(1)  # recompute the last token to get the logits that follow it
        req.prompt_ids = list(session.tokens)
        self.scheduler.add(req)
        self.metrics.prompt_tokens.inc(len(session.pending))
        self._update_gauges()
        self._wake.set()
        return req

    def cancel(self, req: Request) -> None:
        if req.finished is None:
            req.cancelled = True
            self._wake.set()

    # ---- the loop --------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            batch = self.scheduler.schedule()
            self._update_gauges()
            if not batch:
                self._wake.clear()
                self._observe_finished()  # requests cancelled while waiting
                if not self.scheduler.has_work():
                    await self._wake.wait()
                else:  # work that cannot run yet (nothing fits): look again shortly
                    await asyncio.sleep(0.005)
                continue
            rows = [self.scheduler.by_id[c.request_id].sample_row() for c in batch.chunks if c.sample]
            try:
                sampled = await asyncio.wrap_future(submit_started(self._worker, self.runner.run, batch, rows))
            except Exception as e:  # one bad step fails its requests, never the server
                log.exception("step failed")
                self.scheduler.fail_step(batch, e)
                self._observe_finished()
                continue
            self.metrics.step_sessions.observe(len(batch.chunks))
            self.metrics.generation_tokens.inc(len(sampled))
            self.scheduler.postprocess(batch, sampled)
            self._observe_finished()

    def _observe_finished(self) -> None:
        m = self.metrics
        for req in self.scheduler.take_retired():
            f = req.finished
            m.finished(f.reason)
            now = time.monotonic()
            m.e2e.observe(now - req.arrival)
            if req.admitted_at is not None:
                m.queue.observe(req.admitted_at - req.arrival)
            if req.first_token_at is not None:
                m.ttft.observe(req.first_token_at - req.arrival)
                if f.completion_tokens > 1:
                    m.tpot.observe((req.last_token_at - req.first_token_at) / (f.completion_tokens - 1))
        m.preemptions.inc(self.scheduler.take_preemptions())
        m.evictions.inc(self.scheduler.take_evictions())
        m.sessions.set(len(self.sessions))

    def _update_gauges(self) -> None:
        used = self.pool.used()
        self.metrics.kv_bytes.set(used)
        self.metrics.kv_usage.set(used / self.pool.budget)
        self.metrics.running.set(len(self.scheduler.running))
        self.metrics.waiting.set(len(self.scheduler.waiting))


def kv_dtype(config: EngineConfig, model: LoadedModel) -> torch.dtype:
    """float16 KV beside approximate weights halves KV memory and the bytes attention reads; the exact
    f32 mode keeps the model's dtype, so its outputs stay those of the reference."""
    if config.kv_dtype == "auto":
        return torch.float16 if model.weights != "f32" else model.dtype
    return getattr(torch, config.kv_dtype)


def _with_max_tokens(params: SamplingParams, n: int) -> SamplingParams:
    return dataclasses.replace(params, max_tokens=n)
