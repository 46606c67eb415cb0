"""One forward's worth of cache work: which session owns which span of the flat token axis.

Lifecycle: begin (every span validated, room reserved in the pool; nothing else changes) -> the
forward's layers -> the caller's commit (every span's length moves) or abort (reserved blocks go back).
So a refused step changes no session, and one that fails midway leaves every committed length as it was.

With the native kernels loaded, a begun step is bound to the thread that began it
(kernels/bound_step.cpp) and the forward's layers run in C++ straight from the graph; calls the kernel
does not take come to `attend` below, which raises the typed errors or serves them itself.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from .errors import CacheError, PoolExhausted, PositionMismatch
from .session_cache import SessionCache

_THREAD = threading.local()  # the step each thread's forwards serve (set through a registry)


def bind(step: ActiveStep | None) -> None:
    previous = getattr(_THREAD, "step", None)
    if previous is not None and previous is not step:
        previous.unbind()
    _THREAD.step = step
    if step is not None:
        step.bind()


def bound() -> ActiveStep | None:
    """The step this thread's forwards serve, if any."""
    return getattr(_THREAD, "step", None)


class ActiveStep:
    """Spans of the token axis, in order, each owned by one session cache; the caller commits or aborts
    after each forward, and every layer may run natively."""

    def __init__(self, spans: list[tuple[SessionCache, int | None]], native: bool = False) -> None:
        if not spans:
            raise CacheError("an active step needs at least one span")
        n_layers = {cache.config.n_layers for cache, _ in spans}
        if len(n_layers) != 1:
            raise CacheError(f"caches of one step must have the same number of layers, got {sorted(n_layers)}")
        if len({id(cache) for cache, _ in spans}) != len(spans):
            raise CacheError("a session may own only one span of a step")
        dtypes = {cache.config.dtype for cache, _ in spans}
        if native and len(dtypes) != 1:
            native = False  # the kernel reads one cache dtype a call
        self.spans, self.n_layers, self.native = spans, n_layers.pop(), native
        self.sizes: list[int] | None = None  # set by begin
        self._next_layer = 0  # the Python path's count of layers run (the native kernel keeps its own)
        self._bound = False
        if all(n is not None for _, n in spans):
            self.begin(sum(n for _, n in spans))

    # ---- lifecycle -----------------------------------------------------------------------------
    @property
    def begun(self) -> bool:
        return self.sizes is not None

    def begin(self, n_tokens: int) -> None:
        """Validate every span and reserve its room; raises (changing nothing) if any does not fit."""
        # A span of None tokens (a lone session activated by key) owns the whole step.
        sizes = [n_tokens if n is None else n for _, n in self.spans]
        if sum(sizes) != n_tokens:
            raise CacheError(f"the active spans cover {sum(sizes)} tokens but the step carries {n_tokens}")
        for (cache, _), n in zip(self.spans, sizes):
            cache.check_extend(n)  # every session is checked before any grows
        demand: dict[int, int] = {}
        for (cache, _), n in zip(self.spans, sizes):
            demand[id(cache.pool)] = demand.get(id(cache.pool), 0) + cache.pool_demand(n)
        for cache, _ in self.spans:
            if demand[id(cache.pool)] > cache.pool.available():
                raise PoolExhausted(demand[id(cache.pool)], cache.pool.available())
        for (cache, _), n in zip(self.spans, sizes):
            cache.reserve(n)
        self.sizes, self.offsets = sizes, _starts(sizes)
        self.lengths = [cache.length for cache, _ in self.spans]
        self._next_layer = 0

    def next_layer(self) -> int:
        return torch.ops.kvcache_native.bound_next_layer() if self._bound else self._next_layer

    def commit(self) -> None:
        """Every span's tokens join its history; the step can begin again."""
        if not self.begun:
            raise CacheError("commit() needs a begun step")
        if self.next_layer() != self.n_layers:
            raise CacheError(f"the forward ran {self.next_layer()} of {self.n_layers} layers; abort() the step instead")
        for (cache, _), n in zip(self.spans, self.sizes):
            cache.commit(n)
        self._end()

    def abort(self) -> None:
        """Give back what begin reserved; every history stays as it was."""
        if self.begun:
            for cache, _ in self.spans:
                cache.trim()
            self._end()

    def _end(self) -> None:
        self.sizes = None
        self.unbind()

    # ---- the native binding --------------------------------------------------------------------
    def bind(self) -> None:
        if not (self.native and self.begun):
            return
        caches = [cache for cache, _ in self.spans]
        starts, flat = [], []
        for cache in caches:
            starts.append(len(flat))
            flat.extend(cache.read_table())
        torch.ops.kvcache_native.bind_step(
            [c.pool.k for c in caches], [c.pool.v for c in caches], torch.tensor(flat, dtype=torch.long),
            starts, self.offsets, self.lengths, self.sizes, self.n_layers,
        )
        self._bound = True

    def unbind(self) -> None:
        if self._bound:
            self._bound = False
            torch.ops.kvcache_native.unbind_step()

    # ---- the Python path -----------------------------------------------------------------------
    def attend(self, q, k, v, position, layer_id: int, scale: float, out_dtype: torch.dtype, window: int = 0,
               softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if q.shape[0] != 1:
            raise CacheError(f"the token axis is flat: batch must be 1, got {q.shape[0]}")
        if layer_id == 0:
            self._start_forward(position, q.shape[2])
        elif not self.begun or self.next_layer() != layer_id:
            raise CacheError(f"layers must run in order 0..{self.n_layers - 1}; got layer {layer_id} out of turn")
        if self.native and not self._bound:
            self.bind()
        if self._bound:
            out = torch.ops.kvcache_native.attend_bound(q.float(), k.float(), v.float(), layer_id, scale, window, softcap,
                                                        sinks)
        else:
            out = self._attend_each(q, k, v, layer_id, scale, window, softcap, sinks)
            self._next_layer = layer_id + 1
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def _start_forward(self, position: torch.Tensor, n_tokens: int) -> None:
        if self.begun and self.next_layer() != 0:
            raise CacheError("a forward must be committed or aborted before the next one starts")
        if not self.begun:
            self.begin(n_tokens)
        try:
            if sum(self.sizes) != n_tokens:
                raise CacheError(f"the active spans cover {sum(self.sizes)} tokens but the step carries {n_tokens}")
            self._check_positions(position)
        except CacheError:
            self.abort()
            raise

    def _check_positions(self, position: torch.Tensor) -> None:
        # one tensor from a Python list: a torch.arange per span costs more at 32 sessions
        expected = torch.tensor([p for start, n in zip(self.lengths, self.sizes) for p in range(start, start + n)])
        got = position.reshape(-1)
        if torch.equal(got.to(torch.int64), expected):
            return
        for (cache, _), start, n, at in zip(self.spans, self.lengths, self.sizes, self.offsets):
            span = got[at : at + n].tolist()
            if span != list(range(start, start + n)):
                raise PositionMismatch(
                    f"cache {cache.key!r} holds {start} tokens, so its span must have positions "
                    f"{start}..{start + n - 1}; got {span[:4]}{'...' if n > 4 else ''}"
                )

    def _attend_each(self, q, k, v, layer_id: int, scale: float, window: int, softcap: float,
                     sinks: torch.Tensor | None) -> torch.Tensor:
        """Write and attend span by span with SDPA, over histories gathered from the blocks -> [1, H_q, S, D_v]."""
        outs = []
        for (cache, _), start, n in zip(self.spans, self.offsets, self.sizes):
            qi = q[:, :, start : start + n]  # [1, H_q, n, D]
            ki, vi = k[0, :, start : start + n], v[0, :, start : start + n]  # [H_kv, n, D]
            k_all, v_all = cache.write(layer_id, ki, vi)
            if window > 0 or softcap > 0 or sinks is not None:
                outs.append(_attend_windowed(qi, k_all, v_all, scale, window, softcap, sinks))
            else:
                outs.append(_attend(qi, k_all, v_all, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _attend_windowed(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, scale: float, window: int,
                     softcap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """_attend with a sliding window of `window` keys (0: none), scores capped at +-softcap (0: none), and a
    sink logit per query head (float32 [H_q]) in each row's softmax (None: none)."""
    n, total = q.shape[2], k_all.shape[1]
    # the keys before the first query's window are read by none of them
    start = max(0, total - n - window + 1) if window > 0 else 0
    k_all, v_all = k_all[:, start:].to(q.dtype), v_all[:, start:].to(q.dtype)  # [H_kv, T', D], [H_kv, T', D_v]
    q_pos = torch.arange(total - n, total).unsqueeze(1)  # [n, 1]
    k_pos = torch.arange(start, total).unsqueeze(0)  # [1, T']
    mask = k_pos <= q_pos
    if window > 0:
        mask &= k_pos > q_pos - window  # [n, T']
    if softcap <= 0 and sinks is None:
        return F.scaled_dot_product_attention(q, k_all.unsqueeze(0), v_all.unsqueeze(0), attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // k_all.shape[0]
    k_all, v_all = k_all.repeat_interleave(group, dim=0).float(), v_all.repeat_interleave(group, dim=0).float()  # [H_q, T', D]
    scores = q[0].float() @ k_all.transpose(1, 2) * scale  # [H_q, n, T']
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(-1) @ v_all).unsqueeze(0).to(q.dtype)  # [1, H_q, n, D_v]
    # the sink is one more score of the row's softmax, whose weight goes to no value
    sink = sinks.float().view(-1, 1, 1).expand(-1, n, 1)  # [H_q, n, 1]
    weights = torch.cat((scores, sink), dim=-1).softmax(-1)[..., :-1]
    return (weights @ v_all).unsqueeze(0).to(q.dtype)


def _attend(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, H_q, n, D] over k_all [H_kv, T, D], v_all [H_kv, T, D_v], the last n of T being q's own tokens."""
    n, total = q.shape[2], k_all.shape[1]
    if k_all.dtype != q.dtype:
        k_all, v_all = k_all.to(q.dtype), v_all.to(q.dtype)
    k_all, v_all = k_all.unsqueeze(0), v_all.unsqueeze(0)  # [1, H_kv, T, D], [1, H_kv, T, D_v]
    if n == 1:
        return F.scaled_dot_product_attention(q, k_all, v_all, scale=scale, enable_gqa=True)
    if n == total:
        return F.scaled_dot_product_attention(q, k_all, v_all, is_causal=True, scale=scale, enable_gqa=True)
    # torch's is_causal aligns upper-left; a chunk continuing a history needs lower-right alignment.
    q_pos = torch.arange(total - n, total).unsqueeze(1)  # [n, 1]
    mask = torch.arange(total).unsqueeze(0) <= q_pos  # [n, T]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale, enable_gqa=True)


def _starts(sizes: list[int]) -> list[int]:
    starts, at = [], 0
    for n in sizes:
        starts.append(at)
        at += n
    return starts
