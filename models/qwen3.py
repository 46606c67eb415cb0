"""Qwen3: Llama's blocks with each attention head's q and k RMS-normed before RoPE.

    q_h = rope(q_norm(W_q x)_h),  k_h = rope(k_norm(W_k x)_h)     for each head h

q_norm and k_norm are RMSNorms over head_dim, one weight [D] shared by all heads, applied after the
projection and before the rotation. head_dim comes from the config, independent of dim / n_heads, and the
projections carry no bias (config.qkv_bias stays False).
"""
from __future__ import annotations

from .blocks import Attention, Block, RMSNorm, Transformer, rotate, split_heads
from .config import ModelConfig


class Qwen3Attention(Attention):
    """Attention whose q and k heads pass through their RMSNorm between the head split and RoPE."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        # RoPE comes after the norms, so the fused split-and-rotate (and the one native op fused.py would
        # swap it for) does not fit: heads() splits, norms and rotates in turn
        del self.rotary
        self.q_norm = RMSNorm(config.head_dim, config.norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.norm_eps)

    def heads(self, qkv, cos, sin):
        q, k, v = split_heads(qkv, self.n_heads, self.n_kv_heads, self.head_dim)  # [1, H, n, D] each
        return rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k), cos, sin), v


class Qwen3Transformer(Transformer):
    """The shared decoder, every block's attention a Qwen3Attention."""

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        return Block(config, layer_id, Qwen3Attention(config, layer_id))
