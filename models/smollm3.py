"""SmolLM3: Llama's blocks, but some layers ("NoPE" layers, every fourth in the released models) apply no
RoPE at all: their q and k enter attention as projected,

    q_h = (W_q x)_h,  k_h = (W_k x)_h          for layer ids in config.layers_without_rope

so position reaches them only through the causal mask and what earlier layers wrote into the residual.
transformers' config lists it as `no_rope_layers`, one flag a layer with 1 meaning *use* RoPE; config.py
turns that into the ids of the layers that skip it.
"""
from __future__ import annotations

from torch import nn

from .blocks import Block, Transformer, split_heads
from .config import ModelConfig


class UnrotatedQKV(nn.Module):
    """Split a fused qkv projection into heads and rotate nothing (a NoPE layer); cos and sin go unused."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim

    def forward(self, qkv, cos, sin):
        return split_heads(qkv, self.n_heads, self.n_kv_heads, self.head_dim)  # [1, H, n, D] each


class SmolLM3Transformer(Transformer):
    """The shared decoder, its NoPE layers' attention splitting heads without rotating them."""

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        block = Block(config, layer_id)
        if layer_id in config.layers_without_rope:
            block.self_attn.rotary = UnrotatedQKV(config.n_heads, config.n_kv_heads, config.head_dim)
        return block
