"""Phi-3's "longrope" RoPE scaling (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini), read from a config.json or GGUF
metadata into ModelConfig's rope_freq_factors (a divisor for each RoPE frequency, as Llama 3's GGUF rope_freqs)
and rope_attn_factor (cos and sin are multiplied by it), which the shared blocks apply:

    inv_freq_i = theta ** (-2i / R) / f_i             f: the long_factor list or the short_factor list, R/2 long
    cos, sin  *= sqrt(1 + ln(s) / ln(original))       s = max_position / original; 1 where s <= 1

Which list: transformers switches from the short to the long factors once a sequence passes
original_max_position_embeddings (Phi3's longrope_frequency_update), and drops its whole cache when it does
(Phi3ForCausalLM.prepare_inputs_for_generation): every cached key was rotated by the other frequencies. Our cache
outlives a request (sessions, shared prefixes), so it cannot be re-rotated mid-conversation. As llama.cpp does
(llama_model::get_rope_factors: the long factors when the context n_ctx_seq passes n_ctx_orig_yarn, once for the
whole run), the choice is made once, by the context served: the model's whole context (max_position_embeddings,
llama.cpp's default n_ctx too), so the long factors for every longrope checkpoint released (131072 over 4096).
A prompt within the original context is then rotated as llama.cpp rotates it, not as transformers does.

Plain data, as config.py is; hf_config.py and gguf_config.py call in here.
"""
from __future__ import annotations

import math
from typing import Any

from .config import UnsupportedModel

# "su": older Phi-3 config.json files' name for longrope, which transformers' Phi3Config renames
HF_LONGROPE_TYPES = ("longrope", "su")
# transformers' Phi3Config default for original_max_position_embeddings
PHI3_ORIGINAL_CONTEXT = 4096


def attention_factor(max_context: int, original: int, factor: float | None = None) -> float:
    """The cos/sin multiplier transformers and llama.cpp's converter compute when the checkpoint gives none."""
    scale = factor if factor is not None else max_context / original
    return math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0


def chosen_factors(long, short, max_context: int, original: int, rotary_dim: int, source: str) -> tuple[float, ...]:
    """The long factors when the context served passes the original one, else the short (see the docstring)."""
    for name, factors in (("long", long), ("short", short)):
        if factors is None or len(factors) != rotary_dim // 2:
            got = "none" if factors is None else len(factors)
            raise UnsupportedModel(f"{source}: longrope needs {rotary_dim // 2} {name} factors, one per RoPE "
                                   f"frequency of the {rotary_dim} rotated dims; got {got}")
    return tuple(float(x) for x in (long if max_context > original else short))


def hf_longrope(cfg: dict[str, Any], rotary_dim: int, max_context: int) -> dict[str, Any] | None:
    """ModelConfig's RoPE fields for a phi3 config.json whose rope scaling is longrope; None for another kind."""
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if rs.get("rope_type", rs.get("type")) not in HF_LONGROPE_TYPES:
        return None
    # transformers' Phi3Config puts its top-level field (4096 when absent) over the rope dict's
    original = int(cfg.get("original_max_position_embeddings", PHI3_ORIGINAL_CONTEXT))
    factor, attn = rs.get("factor"), rs.get("attention_factor")
    return dict(
        rope_theta=float(cfg.get("rope_theta", rs.get("rope_theta", 10000.0))),
        rope_scaling=None,
        rope_freq_factors=chosen_factors(rs.get("long_factor"), rs.get("short_factor"), max_context, original,
                                         rotary_dim, "config.json rope_scaling"),
        rope_attn_factor=float(attn) if attn is not None else attention_factor(max_context, original, factor),
    )


def gguf_longrope(meta: dict[str, Any], arch: str, factors: dict[str, list[float]], max_context: int,
                  rotary_dim: int) -> dict[str, Any]:
    """ModelConfig's RoPE fields from llama.cpp's longrope files: the rope_factors_long and rope_factors_short
    tensors (in `factors`), rope.scaling.attn_factor and rope.scaling.original_context_length; {} where the file
    has none of them."""
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    long, short = factors.get("rope_factors_long"), factors.get("rope_factors_short")
    if attn is None and long is None and short is None:
        return {}
    if arch != "phi3":  # llama.cpp's converter writes them for phi3 only, of the architectures served here
        raise UnsupportedModel(f"{arch}: longrope RoPE scaling (rope_factors_long, rope.scaling.attn_factor) is "
                               f"implemented for phi3 only")
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length", max_context))
    return dict(
        rope_freq_factors=chosen_factors(long, short, max_context, original, rotary_dim, "GGUF rope_factors"),
        rope_attn_factor=float(attn) if attn is not None else 1.0,  # llama.cpp's default
    )
