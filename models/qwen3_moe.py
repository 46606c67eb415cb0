"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention, q and k RMS-normed per head before
RoPE, and in every layer a mixture of experts in place of the MLP (moe.py):

    x = x + attn(norm(x));  x = x + moe(norm(x))      moe: softmax router, top k, SwiGLU experts
"""
from __future__ import annotations

from .blocks import Block, Transformer
from .config import ModelConfig
from .moe import SparseMoE
from .qwen3 import Qwen3Attention


class Qwen3MoeTransformer(Transformer):
    """The shared decoder, each block's attention Qwen3's and its feed-forward a SparseMoE."""

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        block = Block(config, layer_id, Qwen3Attention(config, layer_id))
        block.mlp = SparseMoE(config)
        return block
