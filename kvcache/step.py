"""One forward's worth of cache work: which session owns which span of the flat token axis."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .errors import CacheError, PositionMismatch
from .session_cache import SessionCache


# Longer spans go to SDPA. The native kernel attends a span token by token, yet measured faster than
# SDPA at every length tried, up to this one (512-token prefill, 30 layers: 95 against 147 ms on float16
# caches, which SDPA must first widen; mixed decode + 32-token chunk steps: 10 against 15 ms).
NATIVE_MAX_SPAN = 512
NATIVE_DTYPES = (torch.float32, torch.float16)  # cache dtypes kvcache_native::attend_spans reads


class ActiveStep:
    """Spans of the token axis, in order, each owned by one session cache.

    Layer 0 of a forward validates every span (positions continue each history, every session fits)
    and reserves room before any layer writes; the last layer commits every span's length. So a
    refused step changes no session, and one that fails midway leaves every committed length as it was.
    """

    def __init__(self, spans: list[tuple[SessionCache, int]], native: bool = False) -> None:
        if not spans:
            raise CacheError("an active step needs at least one span")
        n_layers = {cache.config.n_layers for cache, _ in spans}
        if len(n_layers) != 1:
            raise CacheError(f"caches of one step must have the same number of layers, got {sorted(n_layers)}")
        if len({id(cache) for cache, _ in spans}) != len(spans):
            raise CacheError("a session may own only one span of a step")
        self.spans = spans
        self.n_layers = n_layers.pop()
        self.native = native  # kvcache_native::attend_spans is loaded: short float32/float16 spans skip the Python loop
        self._next_layer: int | None = None  # None: no forward in progress
        self._armed = False  # the native kernel holds layers 1..L-2 of this forward (kernels/armed_step.cpp)

    def _begin(self, position: torch.Tensor, n_tokens: int) -> None:
        # A span of None tokens (a lone session activated by key) owns the whole step.
        sizes = [n_tokens if n is None else n for _, n in self.spans]
        if sum(sizes) != n_tokens:
            raise CacheError(f"the active spans cover {sum(sizes)} tokens but the step carries {n_tokens}")
        # one tensor from a Python list: a torch.arange per span cost ~30 us each, 1-2 ms a step at 32 sessions
        expected = torch.tensor([p for (c, _), n in zip(self.spans, sizes) for p in range(c.length, c.length + n)])
        got = position.reshape(-1)
        if not torch.equal(got.to(torch.int64), expected):
            for (cache, _), n, start in zip(self.spans, sizes, _starts(sizes)):
                span = got[start : start + n].tolist()
                if span != list(range(cache.length, cache.length + n)):
                    raise PositionMismatch(
                        f"cache {cache.key!r} holds {cache.length} tokens, so its span must have positions "
                        f"{cache.length}..{cache.length + n - 1}; got {span[:4]}{'...' if n > 4 else ''}"
                    )
        for (cache, _), n in zip(self.spans, sizes):
            cache.check_extend(n)  # every session is checked before any grows
        for (cache, _), n in zip(self.spans, sizes):
            cache.reserve(n)
        self.sizes = sizes
        self.offsets = _starts(sizes)
        # Spans the C++ kernel takes (storage is final now that every reserve has run); the rest use SDPA.
        # The kernel reads float32 or float16 caches, one dtype a call: the first short span's.
        native_dtype = next((c.config.dtype for c, _ in self.spans if c.config.dtype in NATIVE_DTYPES), None)
        self.short = [
            i for i, ((cache, _), n) in enumerate(zip(self.spans, sizes))
            if self.native and n <= NATIVE_MAX_SPAN and cache.config.dtype == native_dtype
        ]
        self.long = sorted(set(range(len(sizes))) - set(self.short))
        storage = [self.spans[i][0].storage() for i in self.short]
        self.short_args = (
            [k for k, _ in storage], [v for _, v in storage], [self.offsets[i] for i in self.short],
            [self.spans[i][0].length for i in self.short], [sizes[i] for i in self.short],
        )

    def attend(self, q, k, v, position, layer_id: int, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
        if q.shape[0] != 1:
            raise CacheError(f"the token axis is flat: batch must be 1, got {q.shape[0]}")
        if layer_id == 0:
            self._next_layer = None
            if self.native:
                self.disarm()  # a step armed before (this one or another) never carries into a new forward
            self._begin(position, q.shape[2])
        elif self._armed:
            self._next_layer = self.disarm()  # the native kernel ran the layers up to the one it handed back
        if layer_id > 0 and self._next_layer != layer_id:
            self._next_layer = None
            raise CacheError(f"layers must run in order 0..{self.n_layers - 1}; got layer {layer_id} out of turn")
        if self.short and q.dtype == torch.float32:
            out = self._attend_native(q, k, v, layer_id, scale)
        else:
            out = self._attend_each(q, k, v, layer_id, scale, range(len(self.spans)))
        self._next_layer = layer_id + 1
        if layer_id == 0 and self.short and not self.long and q.dtype == torch.float32 and self.n_layers > 2:
            torch.ops.kvcache_native.arm_step(*self.short_args, 1, self.n_layers - 2)
            self._armed = True
        if layer_id == self.n_layers - 1:
            for (cache, _), n in zip(self.spans, self.sizes):
                cache.commit(n)
            self._next_layer = None
        return out if out.dtype == out_dtype else out.to(out_dtype)

    def disarm(self) -> int:
        """Take back the layers the native kernel holds -> the next layer it expected (-1: none armed)."""
        self._armed = False
        return torch.ops.kvcache_native.disarm_step()

    def _attend_each(self, q, k, v, layer_id: int, scale: float, which) -> torch.Tensor:
        """Write and attend span by span with SDPA -> [1, H_q, S_which, D_v] (the listed spans' rows, in order)."""
        outs = []
        for i in which:
            start, n, cache = self.offsets[i], self.sizes[i], self.spans[i][0]
            qi = q[:, :, start : start + n]  # [1, H_q, n, D]
            ki, vi = k[0, :, start : start + n], v[0, :, start : start + n]  # [H_kv, n, D]
            outs.append(_attend(qi, *cache.write(layer_id, ki, vi), scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    def _attend_native(self, q, k, v, layer_id: int, scale: float) -> torch.Tensor:
        out = torch.ops.kvcache_native.attend_spans(q, k, v, layer_id, scale, *self.short_args)  # [1, H_q, S, D_v]
        for i in self.long:
            start, n = self.offsets[i], self.sizes[i]
            out[:, :, start : start + n] = self._attend_each(q, k, v, layer_id, scale, [i])
        return out


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
