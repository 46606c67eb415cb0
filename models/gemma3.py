"""Gemma 3 (text) and Gemma 2: the shared attention, through the one op with each layer's window, inside
Gemma's block:

    h   = x + post_attention_norm(attention(input_norm(x)))
    out = h + post_feedforward_norm(down(gelu_tanh(gate(m)) * up(m))),   m = pre_feedforward_norm(h)

- The embedding's output is scaled by sqrt(dim), the factor first rounded to the embedding's dtype (as
  transformers does: 55.5, not 55.43, for a bfloat16 table of 3072).
- Gemma's RMSNorm scales by (1 + w). The loaders store 1 + w (llama.cpp's converter wrote it so into GGUF
  files; hf_loader adds the 1 to a config.json folder's norms), so every norm here is the shared RMSNorm, and
  fused.py's native norm applies to it as it is.
- Each layer is sliding_attention (config.window(i) > 0: it attends the last w positions) or full_attention.
  Gemma 3's sliding layers rotate with rope_theta_local and no scaling, its full ones with rope_theta and
  rope_scaling; Gemma 2 rotates every layer alike.
- Gemma 3 RMS-norms q and k per head before RoPE (qwen3.py's attention); Gemma 2 has no such norms, but caps
  each attention score at +-attn_logit_softcap (the op's softcap).
- Queries are scaled by query_pre_attn_scalar ** -0.5 (config.attention_scale); the logits are capped at
  +-final_logit_softcap where the config sets one.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import Attention, Block, RMSNorm, Transformer, rope_inv_freq, rope_tables
from .config import ModelConfig
from .qwen3 import Qwen3Attention


class GeGLU(nn.Module):
    """gelu_tanh(gate) * up, from the fused gate/up projection [..., 2 * ffn] (gate rows first)."""

    def forward(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)  # [..., ffn] each
        return F.gelu(gate, approximate="tanh") * up


class GemmaBlock(Block):
    """Norms before and after the attention and before and after the GeGLU feed-forward."""

    def __init__(self, config: ModelConfig, layer_id: int, attention: Attention) -> None:
        super().__init__(config, layer_id, attention)
        self.mlp.act = GeGLU()
        self.pre_feedforward_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, positions, cos, sin):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, cos, sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Transformer(Transformer):
    """The shared decoder with Gemma's blocks, scaled embeddings, a RoPE table for each kind of layer and
    capped logits."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.register_buffer("windowed_inv_freq", self.windowed_rope(), persistent=False)
        self.register_buffer("embed_scale", torch.tensor(config.dim**0.5), persistent=False)

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        return GemmaBlock(config, layer_id, Qwen3Attention(config, layer_id))

    def windowed_rope(self) -> torch.Tensor:
        """The sliding layers' inverse frequencies: rope_theta_local, unscaled."""
        c = self.config
        return rope_inv_freq(dataclasses.replace(c, rope_theta=c.rope_theta_local or c.rope_theta, rope_scaling=None))

    def reset_constants(self) -> None:
        super().reset_constants()
        self.windowed_inv_freq = self.windowed_rope()
        self.embed_scale = torch.tensor(self.config.dim**0.5)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As Transformer.forward."""
        x = self.embed_tokens(tokens)  # [1, n, dim]
        x = x * self.embed_scale.to(x.dtype)
        full = rope_tables(positions, self.inv_freq, x.dtype)  # cos, sin [n, D] each
        windowed = rope_tables(positions, self.windowed_inv_freq, x.dtype)
        for block in self.layers:
            x = block(x, positions, *(windowed if block.self_attn.window > 0 else full))
        logits, hidden = self.outputs(x[0], logits_indices, hidden_indices)  # [m, vocab], [h, dim]
        cap = self.config.final_logit_softcap
        return (cap * torch.tanh(logits / cap) if cap else logits), hidden


class Gemma2Transformer(Gemma3Transformer):
    """Gemma 3's decoder without the q/k norms, its attention scores capped (config.attn_logit_softcap), and one
    RoPE for every layer."""

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        return GemmaBlock(config, layer_id, Attention(config, layer_id))

    def windowed_rope(self) -> torch.Tensor:
        c = self.config
        return rope_inv_freq(dataclasses.replace(c, rope_theta=c.rope_theta_local or c.rope_theta))
