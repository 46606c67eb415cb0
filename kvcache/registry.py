"""The registry of installed session caches and of the step the op serves next.

Install a cache once, when its session is created; activate it (alone, or as one span of a
multi-session step) before every forward that should read and extend it. A step is bound to the
thread that activates it, and the op serves the calling thread's step: an engine that steps on its
own thread with its own registry never sees another's. `REGISTRY` below is the default instance.
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from pathlib import Path
from collections.abc import Iterator, Sequence

from .native import NativeUnavailable, load_native
from .errors import CacheError, UnknownCache
from .session_cache import SessionCache
from . import step as steps
from .step import ActiveStep

SpanSpec = str | tuple[str, int]
ATTEND_KERNELS = [Path(__file__).parent / "kernels" / name for name in ("attend_spans.cpp", "bound_step.cpp")]


class CacheRegistry:
    """Maps session keys to their caches and holds the active step for update_and_attend."""

    def __init__(self) -> None:
        self._caches: dict[str, SessionCache] = {}
        self._active: ActiveStep | None = None
        self._active_keys: tuple[str, ...] = ()
        self._lock = threading.RLock()
        self._native: bool | None = None  # None until the first step tries to load the C++ attention

    def native_attention(self) -> bool:
        """Whether kvcache_native::attend_spans is loaded (built on first call; False without AVX2 or a compiler)."""
        if self._native is None:
            try:
                load_native("kvcache_attend", ATTEND_KERNELS)
                self._native = True
            except NativeUnavailable as e:
                warnings.warn(f"falling back to per-span SDPA attention: {e}", stacklevel=3)
                self._native = False
        return self._native

    def install(self, key: str, cache: SessionCache) -> SessionCache:
        """Register `cache` under `key`; the registry gives its blocks back to the pool when it is uninstalled."""
        with self._lock:
            if key in self._caches:
                raise CacheError(f"a cache is already installed under key {key!r}")
            cache.key = key
            self._caches[key] = cache
            return cache

    def uninstall(self, key: str) -> SessionCache:
        with self._lock:
            cache = self._caches.pop(key, None)
            if cache is None:
                raise UnknownCache(f"no cache is installed under key {key!r}")
            if key in self._active_keys:
                self._make_active(None, ())
            cache.release()
            return cache

    def get(self, key: str) -> SessionCache:
        cache = self._caches.get(key)
        if cache is None:
            raise UnknownCache(f"no cache is installed under key {key!r}")
        return cache

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._caches)

    def __contains__(self, key: str) -> bool:
        return key in self._caches

    def __len__(self) -> int:
        return len(self._caches)

    def set_active(self, spans: SpanSpec | Sequence[SpanSpec] | None) -> None:
        """Select what the next forward(s) read and extend; each forward commits itself.

        `"a"` gives session a every token of the step; `[("a", 6), ("b", 1)]` splits the flat token
        axis, in order, between sessions; None deactivates. With every count given, the step is
        validated and its room reserved here (CacheFull or PoolExhausted change nothing).
        """
        with self._lock:
            if spans is None:
                self._make_active(None, ())
                return
            self._make_active(*self._step(spans, auto_commit=True))

    def activate(self, spans: Sequence[tuple[str, int]]) -> ActiveStep:
        """Begin one step (validated, room reserved) for the next forward; the caller then calls its
        commit() once the forward has run, or abort() if it failed, and deactivates."""
        with self._lock:
            step, keys = self._step(spans, auto_commit=False)
            self._make_active(step, keys)
            return step

    def _step(self, spans, auto_commit: bool) -> tuple[ActiveStep, tuple[str, ...]]:
        if isinstance(spans, str):
            spans = [spans]
        resolved: list[tuple[SessionCache, int | None]] = []
        for spec in spans:
            key, n = (spec, None) if isinstance(spec, str) else spec
            if n is None and len(spans) > 1:
                raise CacheError("with several sessions in a step, give each span's token count")
            if n is not None and (not isinstance(n, int) or n <= 0):
                raise CacheError(f"span of {key!r} must have a positive token count, got {n!r}")
            resolved.append((self.get(key), n))
        step = ActiveStep(resolved, native=self.native_attention(), auto_commit=auto_commit)
        return step, tuple(c.key for c, _ in resolved)

    def _make_active(self, step: ActiveStep | None, keys: tuple[str, ...]) -> None:
        if self._active is not None and self._active is not step:
            self._active.abort()  # a replaced step that did not commit gives its reservation back
        self._active, self._active_keys = step, keys
        steps.bind(step)

    def active_keys(self) -> tuple[str, ...]:
        return self._active_keys

    @contextlib.contextmanager
    def active(self, spans: SpanSpec | Sequence[SpanSpec]) -> Iterator[None]:
        """Activate `spans` for the block, then restore whatever was active before."""
        with self._lock:
            saved = (self._active, self._active_keys)
            self._active = None  # the saved step is set aside, not aborted
        self.set_active(spans)
        try:
            yield
        finally:
            with self._lock:
                self._make_active(*saved)


REGISTRY = CacheRegistry()
