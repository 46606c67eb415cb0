"""Native (C++/AVX2) stand-ins for the decoder's modules, swapped in for the fast weight modes.

Each replaces a module of llama.py with kvserve_native ops computing the same float32 math, so a
layer dispatches ~12 ops instead of ~45, or 3 for a q4 block (at batch 1 each dispatch rivals a
small matmul).
"""
from __future__ import annotations

import torch
from torch import nn

from .llama import Block, QKVRotary, RMSNorm, SwiGLU
from .quant import LinearBlocks


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


class NativeBlock(nn.Module):
    """A Block whose four projections are q4: kvserve_native::block_head, the attention op, block_tail."""

    def __init__(self, block: Block) -> None:
        super().__init__()
        attn, mlp = block.self_attn, block.mlp
        self.layer_id, self.head_dim = attn.layer_id, attn.head_dim
        self.n_heads, self.n_kv_heads = attn.rotary.n_heads, attn.rotary.n_kv_heads
        self.eps = block.input_layernorm.eps
        self.input_norm, self.post_norm = block.input_layernorm.weight, block.post_attention_layernorm.weight
        self.qkv_bias = attn.qkv_proj.bias
        for name, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
            self.register_buffer(name, linear.packed)

    @staticmethod
    def fits(block: Block) -> bool:
        attn, mlp = block.self_attn, block.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms_agree = block.input_layernorm.eps == block.post_attention_layernorm.eps
        return norms_agree and all(isinstance(m, LinearBlocks) and m.fmt == "q4" for m in linears) and all(
            m.bias is None for m in linears[1:]
        )

    def forward(self, x, positions, cos, sin):
        q, k, v = torch.ops.kvserve_native.block_head(
            x, self.input_norm, self.qkv, self.qkv_bias, cos, sin, self.n_heads, self.n_kv_heads, self.eps
        )  # [1, H, n, D] each
        out = torch.ops.kvcache.update_and_attend(q, k, v, positions, self.layer_id, self.head_dim**-0.5, x.dtype)
        return torch.ops.kvserve_native.block_tail(
            x, out, self.o, self.post_norm, self.gate_up, self.down, self.eps
        )


_NATIVE = {RMSNorm: NativeRMSNorm, QKVRotary: NativeQKVRotary, SwiGLU: lambda _: NativeSwiGLU()}


def use_native_modules(model: nn.Module) -> nn.Module:
    """Swap q4 Blocks for NativeBlock, and elsewhere RMSNorm, QKVRotary and SwiGLU for their native ops
    (float32 models; kernels loaded)."""
    swapped: list[str] = []
    for name, child in list(model.named_modules()):
        if not name or any(name.startswith(prefix + ".") for prefix in swapped):
            continue
        if isinstance(child, Block) and NativeBlock.fits(child):
            model.set_submodule(name, NativeBlock(child))
            swapped.append(name)
        elif (native := _NATIVE.get(type(child))) is not None:
            model.set_submodule(name, native(child))
    return model
