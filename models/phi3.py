"""Phi-3 / Phi-4(-mini): Llama's blocks, with RoPE on only the first rope_dim dims of each q and k head
when the config's partial_rotary_factor is below 1 (Phi-4-mini: 0.75, 96 of 128):

    q_h = concat(rope(q_h[:R]), q_h[R:]),  k_h likewise,      R = config.rotary_dim

The checkpoint already fuses q, k, v into qkv_proj (in that order) and gate, up into gate_up_proj (gate
first), the layout the shared blocks use, so the weights load as they are. Long-context "longrope" RoPE
and sliding windows shorter than the context are refused in config.py.
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
