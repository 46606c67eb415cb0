"""Llama, and the architectures that are its math with other options: Qwen2 (a bias on the q, k and v
projections, config.qkv_bias) and Mistral (Llama's blocks, every layer attending through config.sliding_window
where it is shorter than the context). The blocks live in blocks.py, shared with qwen3.py, smollm3.py and phi3.py; this
module names them as the Llama decoder, as the rest of the project imports them."""
from __future__ import annotations

from .blocks import (MLP, Attention, Block, Layers, QKVRotary, RMSNorm, SwiGLU, Transformer, rope_inv_freq, rotate,
                     split_heads)

__all__ = ["MLP", "Attention", "Block", "Layers", "QKVRotary", "RMSNorm", "SwiGLU", "Transformer", "rope_inv_freq",
           "rotate", "split_heads"]
