"""YaRN RoPE scaling (gpt-oss), read from a config.json or GGUF metadata into ModelConfig's rope_scaling and
rope_attn_factor (cos and sin are multiplied by it), and its frequencies:

    inv_freq_i = interp_i (1 - e_i) + extrap_i e_i      extrap_i = theta ** (-2i / R), interp_i = extrap_i / factor
    e_i = 1 - clamp((i - low) / (high - low), 0, 1)     low, high: the dims whose wavelengths turn beta_fast and
                                                        beta_slow times in the original context
    cos, sin *= 0.1 ln(factor) + 1

transformers rounds low down and high up only where the config says `truncate` (gpt-oss says false); llama.cpp
always rounds them (ggml_rope_yarn_corr_dims), so a GGUF file's YaRN is llama.cpp's.

Plain data, as config.py is; hf_config.py and gguf_config.py call in here.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from .config import RopeScaling, UnsupportedModel


def attention_factor(factor: float) -> float:
    """YaRN's mscale: what cos and sin are multiplied by."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def hf_yarn(rs: dict[str, Any], theta: float) -> dict[str, Any]:
    """A config.json's yarn rope_scaling (or rope_parameters) -> ModelConfig's rope fields."""
    if rs.get("mscale") or rs.get("mscale_all_dim"):
        raise UnsupportedModel("YaRN with mscale / mscale_all_dim (DeepSeek's) is not implemented")
    factor = float(rs["factor"])
    scaling = RopeScaling("yarn", factor, original_max_position=int(rs["original_max_position_embeddings"]),
                          beta_fast=float(rs.get("beta_fast") or 32.0), beta_slow=float(rs.get("beta_slow") or 1.0),
                          truncate=bool(rs.get("truncate", True)))
    given = rs.get("attention_factor")
    return dict(rope_theta=theta, rope_scaling=scaling,
                rope_attn_factor=float(given) if given is not None else attention_factor(factor))


def gguf_yarn(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    """A GGUF's yarn rope.scaling.* -> ModelConfig's rope fields, as llama.cpp applies them."""
    factor = float(meta[f"{arch}.rope.scaling.factor"])
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise UnsupportedModel(f"GGUF file lacks metadata field {arch}.rope.scaling.original_context_length")
    scaling = RopeScaling("yarn", factor, original_max_position=int(original), truncate=True)
    return dict(rope_scaling=scaling, rope_attn_factor=attention_factor(factor))


def yarn_inv_freq(theta: float, dim: int, rs: RopeScaling) -> torch.Tensor:
    """The YaRN inverse frequencies [dim // 2] float64 of a head's `dim` rotated dims."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers and llama.cpp, against a zero width
    extrapolation = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # how much of each frequency is the original's
    return extrapolation / rs.factor * (1 - kept) + extrapolation * kept
