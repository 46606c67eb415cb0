"""The decoder blocks every architecture shares, whose attention is kvcache::update_and_attend. Math only.

Llama, Qwen2 and Mistral are these blocks as they are; qwen3.py, smollm3.py and phi3.py each change one step
of them, and gemma3.py the block around the attention. The steps an architecture may change are
`Attention.heads` (the projection's output -> rotated q, k and v heads) and `Transformer.make_block`.
Each layer's attention window (Mistral's, Phi-3's, Gemma's sliding layers), scale and score cap come from the
config and go to the op with the layer's call.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kvcache  # noqa: F401  (registers torch.ops.kvcache.update_and_attend)

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies [rotary_dim // 2], with the config's scaling applied."""
    d = config.rotary_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if config.rope_freq_factors is not None:
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float64)
    rs = config.rope_scaling
    if rs is not None and rs.kind == "yarn":
        from .yarn import yarn_inv_freq

        inv = yarn_inv_freq(config.rope_theta, d, rs)
    elif rs is not None and rs.kind == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.kind == "llama3":
        low_wavelen = rs.original_max_position / rs.low_freq_factor
        high_wavelen = rs.original_max_position / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        smooth = (rs.original_max_position / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    return inv.float()


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n, 1] int64, inv_freq [R/2] -> cos, sin [n, R] in `dtype`, R the rotated dims of a head, both
    times `scale` (longrope's attention factor: it scales the rotated dims only, so it is not the softmax scale)."""
    angles = positions.float() * inv_freq  # [n, R/2]
    angles = torch.cat((angles, angles), dim=-1)  # [n, R]
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE over the whole last dim: x [1, H, n, R], cos/sin [n, R]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def split_heads(qkv: torch.Tensor, n_heads: int, n_kv_heads: int, head_dim: int):
    """The fused projection [1, n, (H_q + 2 H_kv) * D] -> q [1, H_q, n, D], k and v [1, H_kv, n, D]."""
    n, d = qkv.shape[1], head_dim
    q, k, v = qkv.split([n_heads * d, n_kv_heads * d, n_kv_heads * d], dim=-1)
    q = q.view(1, n, n_heads, d).transpose(1, 2)  # [1, H_q, n, D]
    k = k.view(1, n, n_kv_heads, d).transpose(1, 2)  # [1, H_kv, n, D]
    v = v.view(1, n, n_kv_heads, d).transpose(1, 2)  # [1, H_kv, n, D]
    return q, k, v


class QKVRotary(nn.Module):
    """Split a fused qkv projection into heads and rotate q and k, every dim of each head (rotate-half RoPE).
    fused.py swaps this exact class for one native op that does the same."""

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim

    def forward(self, qkv, cos, sin):
        q, k, v = split_heads(qkv, self.n_heads, self.n_kv_heads, self.head_dim)  # [1, H, n, D] each
        return rotate(q, cos, sin), rotate(k, cos, sin), v


class Attention(nn.Module):
    """Grouped-query attention over the session caches of the active step, through the layer's window (0: the
    whole history), scaled by head_dim ** -0.5 unless the config says otherwise, scores capped if it says so."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        c = config
        self.layer_id, self.n_heads, self.n_kv_heads, self.head_dim = layer_id, c.n_heads, c.n_kv_heads, c.head_dim
        self.scale = c.attention_scale if c.attention_scale is not None else c.head_dim**-0.5
        self.window, self.softcap = c.window(layer_id), c.attn_logit_softcap or 0.0
        # q, k and v projections fused into one matmul: one weight read and one op instead of three
        self.qkv_proj = nn.Linear(c.dim, (c.n_heads + 2 * c.n_kv_heads) * c.head_dim, bias=c.qkv_bias)
        self.rotary = QKVRotary(c.n_heads, c.n_kv_heads, c.head_dim)
        self.o_proj = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def heads(self, qkv, cos, sin):
        """qkv [1, n, (H_q + 2 H_kv) * D] -> q [1, H_q, n, D], k and v [1, H_kv, n, D], q and k rotated."""
        return self.rotary(qkv, cos, sin)

    def forward(self, x, positions, cos, sin):
        n = x.shape[1]
        q, k, v = self.heads(self.qkv_proj(x), cos, sin)  # [1, H, n, D] each
        out = self.attend(q, k, v, positions, x.dtype)  # [1, H_q, n, D]
        out = out.transpose(1, 2).reshape(1, n, self.n_heads * self.head_dim)  # [1, n, H_q * D]
        return self.o_proj(out)


    def attend(self, q, k, v, positions, dtype):
        """The op's call: this layer's window, scale and score cap (an architecture may add to it)."""
        return torch.ops.kvcache.update_and_attend(q, k, v, positions, self.layer_id, self.scale, dtype, self.window,
                                                   self.softcap)


class SwiGLU(nn.Module):
    """silu(gate) * up, from the fused gate/up projection [..., 2 * ffn] (gate rows first)."""

    def forward(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)  # [..., ffn] each
        return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.dim, 2 * config.ffn_dim, bias=False)  # gate and up, fused
        self.act = SwiGLU()
        self.down_proj = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Block(nn.Module):
    """Pre-norm transformer block; `attention` replaces the shared one where an architecture's differs."""

    def __init__(self, config: ModelConfig, layer_id: int, attention: Attention | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.self_attn = attention if attention is not None else Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.dim, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, positions, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), positions, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Layers(nn.ModuleList):
    """The decoder's blocks, run in order (one module, so the fast weight modes can swap the whole stack)."""

    def forward(self, x, positions, cos, sin):
        for layer in self:
            x = layer(x, positions, cos, sin)
        return x


class Transformer(nn.Module):
    """Decoder over a flat step of tokens from many sessions; returns logits for the sampled rows only, and
    the final normed hidden states of the rows an embedding pools (none in most steps)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.layers = Layers(self.make_block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def make_block(self, config: ModelConfig, layer_id: int) -> Block:
        """Layer `layer_id`; an architecture whose layers differ overrides this."""
        return Block(config, layer_id)

    def reset_constants(self) -> None:
        """Recompute non-weight tensors after building on the meta device."""
        self.inv_freq = rope_inv_freq(self.config)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                hidden_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [1, n] int64, positions [n, 1] int64, logits_indices [m] int64, hidden_indices [h] int64 ->
        (logits [m, vocab] float32, hidden [h, dim] float32: the final norm's output at those rows)."""
        x = self.embed_tokens(tokens)  # [1, n, dim]
        cos, sin = rope_tables(positions, self.inv_freq, x.dtype, self.config.rope_attn_factor)  # [n, R] each
        x = self.layers(x, positions, cos, sin)[0]  # [n, dim]
        return self.outputs(x, logits_indices, hidden_indices)

    def outputs(self, x: torch.Tensor, logits_indices: torch.Tensor, hidden_indices: torch.Tensor):
        """The last layer's x [n, dim] -> (logits [m, vocab] float32, hidden [h, dim] float32)."""
        logits = self.lm_head(self.norm(x.index_select(0, logits_indices))).float()  # [m, vocab]
        # the norm works row by row, so a row's hidden state does not depend on what shares its step; a
        # step without embedding rows selects none
        hidden = self.norm(x.index_select(0, hidden_indices)).float()  # [h, dim]
        return logits, hidden
