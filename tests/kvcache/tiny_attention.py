"""A tiny multi-layer attention model for the cache tests, with a cacheless reference forward."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kvcache


class TinyAttention(nn.Module):
    """Residual stack of attention layers whose attention is kvcache::update_and_attend."""

    def __init__(self, n_layers=3, dim=32, n_heads=4, n_kv_heads=2, head_dim=8, v_head_dim=8, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.n_heads, self.n_kv_heads, self.head_dim, self.v_head_dim = n_heads, n_kv_heads, head_dim, v_head_dim
        self.scale = head_dim**-0.5

        def w(o, i):
            return nn.Parameter(torch.randn(o, i, generator=g) * i**-0.5)

        self.wq = nn.ParameterList([w(n_heads * head_dim, dim) for _ in range(n_layers)])
        self.wk = nn.ParameterList([w(n_kv_heads * head_dim, dim) for _ in range(n_layers)])
        self.wv = nn.ParameterList([w(n_kv_heads * v_head_dim, dim) for _ in range(n_layers)])
        self.wo = nn.ParameterList([w(dim, n_heads * v_head_dim) for _ in range(n_layers)])

    def cache_config(self, capacity, sizing=kvcache.Sizing.DYNAMIC) -> kvcache.CacheConfig:
        return kvcache.CacheConfig(
            n_layers=len(self.wq), n_kv_heads=self.n_kv_heads, head_dim=self.head_dim,
            v_head_dim=self.v_head_dim, capacity=capacity, sizing=sizing,
        )

    def _qkv(self, i, x, pos):
        s = x.shape[1]
        # positions enter q and k so that a wrong position changes the output
        angle = pos.to(x.dtype) * 0.1  # [S, 1]
        q = (x @ self.wq[i].T).view(1, s, self.n_heads, self.head_dim).transpose(1, 2) * torch.cos(angle)
        k = (x @ self.wk[i].T).view(1, s, self.n_kv_heads, self.head_dim).transpose(1, 2) * torch.cos(angle)
        v = (x @ self.wv[i].T).view(1, s, self.n_kv_heads, self.v_head_dim).transpose(1, 2)
        return q, k, v  # [1, H, S, D]

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """x [1, S, dim], position [S, 1] -> [1, S, dim]."""
        for i in range(len(self.wq)):
            q, k, v = self._qkv(i, x, position)
            a = torch.ops.kvcache.update_and_attend(q, k, v, position, i, self.scale, x.dtype)
            x = x + a.transpose(1, 2).reshape(1, x.shape[1], -1) @ self.wo[i].T  # [1, S, H*D_v] -> [1, S, dim]
        return x

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """Cacheless causal forward over a whole history x [1, T, dim]."""
        pos = torch.arange(x.shape[1]).unsqueeze(1)
        rep = self.n_heads // self.n_kv_heads
        for i in range(len(self.wq)):
            q, k, v = self._qkv(i, x, pos)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            x = x + a.transpose(1, 2).reshape(1, x.shape[1], -1) @ self.wo[i].T
        return x


def positions(start: int, n: int) -> torch.Tensor:
    return torch.arange(start, start + n).unsqueeze(1)  # [n, 1]
