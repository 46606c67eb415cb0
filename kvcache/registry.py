"""The registry of installed session caches and of the step the op serves next.

One lifecycle, as the seed names it: `install` a session's cache once, when the session is created;
`set_active(spans)` before each batched step, which validates the step, reserves its room and returns
its `ActiveStep`; the forward; then the step's `commit()` (every span's length moves) or `abort()`
(reserved blocks go back, every history stays as it was); then `set_active(None)`; `uninstall` when
the session ends. A step is bound to the thread that activates it, and the op serves the calling
thread's step: an engine that steps on its own thread with its own registry never sees another's.
`REGISTRY` below is the default instance.
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

# a span: a cache (or the key it is installed under), with the count of its tokens in the step
Owner = SessionCache | str
SpanSpec = Owner | tuple[Owner, int]
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

    def set_active(self, spans: SpanSpec | Sequence[SpanSpec] | None) -> ActiveStep | None:
        """Begin the next step over `spans` and return it; None ends the active step (aborting it if
        it was neither committed nor aborted).

        `[(a, 6), (b, 1)]` splits the flat token axis, in order, between caches (or installed keys);
        with every count given, the step is validated and its room reserved here (CacheFull or
        PoolExhausted change nothing). A lone cache may come without a count: it owns every token of
        the forward, and the step begins at its first layer. After a commit, the same step may run
        the next forward over the same caches.
        """
        with self._lock:
            if spans is None:
                self._make_active(None, ())
                return None
            if isinstance(spans, (str, SessionCache)):
                spans = [spans]
            resolved: list[tuple[SessionCache, int | None]] = []
            for spec in spans:
                owner, n = (spec, None) if isinstance(spec, (str, SessionCache)) else spec
                if n is None and len(spans) > 1:
                    raise CacheError("with several sessions in a step, give each span's token count")
                if n is not None and (not isinstance(n, int) or n <= 0):
                    raise CacheError(f"span of {owner!r} must have a positive token count, got {n!r}")
                resolved.append((self.get(owner) if isinstance(owner, str) else owner, n))
            step = ActiveStep(resolved, native=self.native_attention())
            self._make_active(step, tuple(c.key for c, _ in resolved))
            return step

    def _make_active(self, step: ActiveStep | None, keys: tuple[str, ...]) -> None:
        if self._active is not None and self._active is not step:
            self._active.abort()  # a replaced step that did not commit gives its reservation back
        self._active, self._active_keys = step, keys
        steps.bind(step)

    def active_keys(self) -> tuple[str, ...]:
        return self._active_keys

    @contextlib.contextmanager
    def active(self, spans: SpanSpec | Sequence[SpanSpec]) -> Iterator[ActiveStep]:
        """set_active(spans) for the block, which runs one forward: it commits when the block ends (or
        aborts if it raised), then whatever was active before is active again."""
        with self._lock:
            saved = (self._active, self._active_keys)
            self._active = None  # the saved step is set aside, not aborted
        try:
            step = self.set_active(spans)
            try:
                yield step
            except BaseException:
                step.abort()
                raise
            if step.begun:
                step.commit()
        finally:
            with self._lock:
                self._make_active(*saved)


REGISTRY = CacheRegistry()
