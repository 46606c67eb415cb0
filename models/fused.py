"""Native (C++/AVX2) stand-ins for the decoder's elementwise modules, swapped in for the fast weight modes.

Each replaces a module of llama.py with one kvserve_native op computing the same float32 math, so a
layer dispatches ~12 ops instead of ~45 (at batch 1 their overhead rivals the matmuls).
"""
from __future__ import annotations

import torch
from torch import nn

from .llama import QKVRotary, RMSNorm, SwiGLU


class NativeRMSNorm(nn.Module):
    """RMSNorm in one kvserve_native::rms_norm call."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.eps, self.weight = norm.eps, norm.weight

    def forward(self, x):
        return torch.ops.kvserve_native.rms_norm(x, self.weight, self.eps)


class NativeQKVRotary(nn.Module):
    """QKVRotary in one kvserve_native::rope_qkv call (q, k, v come out contiguous)."""

    def __init__(self, rotary: QKVRotary) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = rotary.n_heads, rotary.n_kv_heads

    def forward(self, qkv, cos, sin):
        return torch.ops.kvserve_native.rope_qkv(qkv, cos, sin, self.n_heads, self.n_kv_heads)


class NativeSwiGLU(nn.Module):
    """SwiGLU in one kvserve_native::silu_mul call."""

    def forward(self, gate_up):
        return torch.ops.kvserve_native.silu_mul(gate_up)


_NATIVE = {RMSNorm: NativeRMSNorm, QKVRotary: NativeQKVRotary, SwiGLU: lambda _: NativeSwiGLU()}


def use_native_modules(model: nn.Module) -> nn.Module:
    """Swap RMSNorm, QKVRotary and SwiGLU for their native ops (float32 models; kernels loaded)."""
    for name, child in list(model.named_modules()):
        native = _NATIVE.get(type(child))
        if native is not None and name:
            model.set_submodule(name, native(child))
    return model
