"""Phi-3 / Phi-3.5 / Phi-4(-mini): Llama's blocks, with RoPE on only the first rope_dim dims of each q and k
head when the config's partial_rotary_factor is below 1 (Phi-4-mini: 0.75, 96 of 128):

    q_h = concat(rope(q_h[:R]), q_h[R:]),  k_h likewise,      R = config.rotary_dim

The checkpoint already fuses q, k, v into qkv_proj (in that order) and gate, up into gate_up_proj (gate
first), the layout the shared blocks use, so the weights load as they are. The rest comes from the config,
through the shared blocks:
- longrope RoPE (Phi-3-mini-128k, Phi-3.5-mini, Phi-4-mini): each frequency divided by its long or short
  factor (config.rope_freq_factors), cos and sin times config.rope_attn_factor. Which set, and why once for
  the whole context rather than by sequence length as transformers switches, is in longrope.py.
- a sliding window (Phi-3-mini-4k: 2047) on every layer, meant as transformers' Phi3 and Mistral mean it: a
  token attends itself and the window - 1 before it (config.layer_windows, attention_config.py).
"""
from __future__ import annotations

import torch
from torch import nn

from .blocks import Block, Transformer, rotate, split_heads
from .config import ModelConfig


class PartialQKVRotary(nn.Module):
    """Split a fused qkv projection into heads and rotate the first `rope_dim` dims of each q and k head,
    passing the rest through; cos and sin are [n, rope_dim]."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, rope_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim, self.rope_dim = n_heads, n_kv_heads, head_dim, rope_dim

    def forward(self, qkv, cos, sin):
        q, k, v = split_heads(qkv, self.n_heads, self.n_kv_heads, self.head_dim)  # [1, H, n, D] each
        r = self.rope_dim
        q = torch.cat((rotate(q[..., :r], cos, sin), q[..., r:]), dim=-1)  # [1, H_q, n, D]
        k = torch.cat((rotate(k[..., :r], cos, sin), k[..., r:]), dim=-1)  # [1, H_kv, n, D]
        return q, k, v


class Phi3Transformer(Transformer):
    """The shared decoder; with partial RoPE each attention rotates part of each head. With full RoPE
    (Phi-3, Phi-4) the blocks are Llama's exactly, and fused.py may run them as its native decoder."""

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        block = Block(config, layer_id)
        if config.rotary_dim < config.head_dim:
            block.self_attn.rotary = PartialQKVRotary(config.n_heads, config.n_kv_heads, config.head_dim,
                                                      config.rotary_dim)
        return block
