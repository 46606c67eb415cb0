"""gpt-oss (gpt-oss-20b, gpt-oss-120b): Llama's pre-norm blocks with

    attention   biases on q, k, v and the output; a learned sink logit per query head, which joins each
                query's softmax and passes no value (the op's `sinks`); even layers attend through a window
                (128), odd ones the whole history; YaRN RoPE (yarn.py)
    experts     in every layer, in place of the MLP (moe.py): a router with a bias, the top k logits softmaxed
                over those k, experts with biases and the clamped SwiGLU, (up + 1) * gate * sigmoid(1.702 gate)
"""
from __future__ import annotations

import torch
from torch import nn

from .blocks import Attention, Block, Transformer
from .config import ModelConfig
from .moe import SparseMoE


class GptOssAttention(Attention):
    """The shared attention with an output bias and a sink logit a query head, both weights of the file."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__(config, layer_id)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=True)
        self.register_buffer("sinks", torch.empty(config.n_heads))  # [H_q] float32

    def attend(self, q, k, v, positions, dtype):
        return torch.ops.kvcache.update_and_attend(q, k, v, positions, self.layer_id, self.scale, dtype, self.window,
                                                   self.softcap, self.sinks)


class GptOssTransformer(Transformer):
    """The shared decoder, each block's attention GptOssAttention and its feed-forward a SparseMoE with biases."""

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        block = Block(config, layer_id, GptOssAttention(config, layer_id))
        block.mlp = SparseMoE(config, bias=True, swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha)
        return block
