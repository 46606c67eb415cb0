"""kvcache::update_and_attend, the one functional op every attention layer calls.

Shapes (BHSD, flat token axis):
    q        [B=1, H_q,  S, D]
    k        [B=1, H_kv, S, D]      H_q is a multiple of H_kv (GQA/MQA, no per-head copies)
    v        [B=1, H_kv, S, D_v]    D_v may differ from D
    position [S, 1] int64           absolute position of each token in its own session
    window   0: the whole history; w > 0: the token at position p attends positions p - w + 1 .. p
             (a sliding window of w keys, its own included, as transformers' sliding_window)
    softcap  0: none; c > 0: each scaled score s becomes c tanh(s / c) before the softmax (Gemma 2)
    sinks    None, or float32 [H_q]: a learned logit per query head that joins each of its rows' softmax
             as one more score, with no value (gpt-oss): out = sum_j e^s_j v_j / (e^sink + sum_j e^s_j)
    returns  [B=1, H_q,  S, D_v]    in out_dtype
To the tracer the op is pure (mutates_args=()): the graph holds no KV buffers and no cache sizes.
At run time it hands this layer's k/v to the caches of the calling thread's active step (set through a
registry) and attends q over each session's history.
"""
from __future__ import annotations

import torch

from . import step as steps
from .errors import NoActiveCache


# Defined with the plain Library API rather than torch.library.custom_op: the same functional schema,
# without custom_op's per-call aliasing checks and wrappers, which cost more than a decode step's attention.
_LIBRARY = torch.library.Library("kvcache", "DEF")
# window, softcap and sinks have defaults, so calls and saved programs from before they existed run as they did.
_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor position, int layer_id, float scale, ScalarType out_dtype, "
           "int window=0, float softcap=0.0, Tensor? sinks=None) -> Tensor")
_LIBRARY.define("update_and_attend" + _SCHEMA)
# The same call as the registry's Python path. Once the C++ attention is loaded, update_and_attend's CPU
# kernel (kernels/bound_step.cpp) runs the layers of the thread's bound step and hands every other call here.
_LIBRARY.define("attend_active_step" + _SCHEMA)


def update_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    position: torch.Tensor,
    layer_id: int,
    scale: float,
    out_dtype: torch.dtype,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, S, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    if position.shape != (q.shape[2], 1):
        raise ValueError(f"position must be [S, 1] = [{q.shape[2]}, 1], got {tuple(position.shape)}")
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be 0 (none) or positive; got {window}, {softcap}")
    if sinks is not None:
        check_sinks(sinks, q.shape[1])
    step = steps.bound()
    if step is None:
        raise NoActiveCache(
            "kvcache::update_and_attend ran with no active cache: install a session cache and call "
            "REGISTRY.set_active(key) (or use REGISTRY.active(key)) before the forward"
        )
    return step.attend(q, k, v, position, layer_id, scale, out_dtype, window, softcap, sinks)


def check_sinks(sinks: torch.Tensor, n_heads: int) -> None:
    """A sink logit per query head, float32 and finite (an infinite one would swallow or drop every row)."""
    if sinks.dtype != torch.float32 or sinks.shape != (n_heads,):
        raise ValueError(f"sinks must be float32 [H_q] = [{n_heads}]; got {sinks.dtype} {list(sinks.shape)}")
    if not bool(torch.isfinite(sinks).all()):
        raise ValueError("sinks must be finite")


_LIBRARY.impl("update_and_attend", update_and_attend, "CompositeExplicitAutograd")
_LIBRARY.impl("attend_active_step", update_and_attend, "CompositeExplicitAutograd")


@torch.library.register_fake("kvcache::update_and_attend")
def _(q, k, v, position, layer_id, scale, out_dtype, window=0, softcap=0.0, sinks=None):
    return q.new_empty((*q.shape[:-1], v.shape[-1]), dtype=out_dtype)
