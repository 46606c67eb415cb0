"""Native (C++/AVX2) stand-ins for the decoder's modules, swapped in for the fast weight modes.

Each replaces a module of blocks.py with kvserve_native ops computing the same float32 math, so a
layer dispatches ~12 ops instead of ~45, and a Llama decoder of block-format weights two a layer
around its attention call (at batch 1 each dispatch rivals a small matmul).
"""
from __future__ import annotations

import torch
from torch import nn

from .llama import MLP, Attention, Block, Layers, QKVRotary, RMSNorm, SwiGLU
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


class NativeLayers(nn.Module):
    """The decoder's Layers, every projection block-format (any kinds, one or more parts each): two native
    ops around each attention call, so the graph still calls kvcache::update_and_attend once a layer.

        q, k, v = layer_head(x)                                   norm, qkv, bias, RoPE of layer 0
        for each layer l:
            a = kvcache::update_and_attend(q, k, v, positions, l, window of l)
            x, q, k, v = layer_between(x, a)                      tail of l (o, residual, norm, SwiGLU,
                                                                  residual), then the head of l + 1
        (the last layer ends with layer_tail)
    One native call between two attention calls: each call from the graph costs as much as a small matmul
    at batch 1, and the parts of a block do nothing the cache needs to see (models/kernels/block.cpp)."""

    def __init__(self, layers: Layers) -> None:
        super().__init__()
        self.blocks = layers
        first = layers[0].self_attn
        self.n_heads, self.n_kv_heads, self.head_dim = first.rotary.n_heads, first.rotary.n_kv_heads, first.head_dim
        self.eps = layers[0].input_layernorm.eps
        self.windows = [block.self_attn.window for block in layers]  # Mistral's sliding window, or 0

    @staticmethod
    def is_llama_block(block: nn.Module) -> bool:
        """A block computing exactly what the native ops do: the shared Block, Attention (rotating all of each
        head), QKVRotary and MLP as they are. Not a subclass, nor a block with another attention or rotary:
        qwen3's q/k norms, smollm3's NoPE layers and phi3's partial RoPE compute something else, as does an
        attention of another scale or with capped scores (its window goes to the op as it is)."""
        attn = block.self_attn
        return (type(block) is Block and type(attn) is Attention and type(getattr(attn, "rotary", None)) is QKVRotary
                and type(block.mlp) is MLP and type(block.mlp.act) is SwiGLU and attn.scale == attn.head_dim**-0.5
                and not attn.softcap)

    @staticmethod
    def fits(layers: nn.Module) -> bool:
        """Llama blocks whose projections are all LinearBlocks (any kinds), the attention's without bias but
        for qkv, one norm eps and one head layout."""
        if not isinstance(layers, Layers) or len(layers) == 0:
            return False
        first = layers[0]
        for i, block in enumerate(layers):
            if not NativeLayers.is_llama_block(block):
                return False
            attn, mlp = block.self_attn, block.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not (attn.layer_id == i and all(isinstance(m, LinearBlocks) for m in linears)
                    and all(m.bias is None for m in linears[1:])
                    and block.input_layernorm.eps == block.post_attention_layernorm.eps == first.input_layernorm.eps
                    and (attn.rotary.n_heads, attn.rotary.n_kv_heads, attn.head_dim)
                    == (first.self_attn.rotary.n_heads, first.self_attn.rotary.n_kv_heads, first.self_attn.head_dim)):
                return False
        return True

    @staticmethod
    def _parts(linear: LinearBlocks) -> tuple:
        return linear.panels(), list(linear.ns), list(linear.kind_ids)

    def _head(self, block: Block) -> tuple:
        attn = block.self_attn
        return (block.input_layernorm.weight, *self._parts(attn.qkv_proj), attn.qkv_proj.bias)

    def _tail(self, block: Block) -> tuple:
        mlp = block.mlp
        return (*self._parts(block.self_attn.o_proj), block.post_attention_layernorm.weight, *self._parts(mlp.gate_up_proj),
                *self._parts(mlp.down_proj))

    def forward(self, x, positions, cos, sin):
        ops, heads = torch.ops.kvserve_native, (self.n_heads, self.n_kv_heads)
        blocks = list(self.blocks)
        q, k, v = ops.layer_head(x, *self._head(blocks[0]), cos, sin, *heads, self.eps)  # [1, H, n, D] each
        for i, block in enumerate(blocks):
            a = torch.ops.kvcache.update_and_attend(q, k, v, positions, i, self.head_dim**-0.5, x.dtype, self.windows[i])  # [1, Hq, n, Dv]
            if i + 1 < len(blocks):
                x, q, k, v = ops.layer_between(x, a, *self._tail(block), *self._head(blocks[i + 1]), cos, sin, *heads, self.eps)
            else:
                x = ops.layer_tail(x, a, *self._tail(block), self.eps)  # [1, n, C]
        return x


# by exact type: a module of another class (phi3's PartialQKVRotary, smollm3's UnrotatedQKV) computes other
# math and keeps its own forward. RMSNorm holds anywhere, qwen3's q/k heads [1, H, n, D] included: the op
# normalises the last dim of a tensor of any shape.
_NATIVE = {RMSNorm: NativeRMSNorm, QKVRotary: NativeQKVRotary, SwiGLU: lambda _: NativeSwiGLU()}


def use_native_modules(model: nn.Module) -> nn.Module:
    """Swap block-format Llama Layers for NativeLayers, and elsewhere RMSNorm, QKVRotary and SwiGLU for their native ops
    (float32 models; kernels loaded)."""
    swapped: list[str] = []
    for name, child in list(model.named_modules()):
        if not name or any(name.startswith(prefix + ".") for prefix in swapped):
            continue
        if NativeLayers.fits(child):
            model.set_submodule(name, NativeLayers(child))
            swapped.append(name)
        elif (native := _NATIVE.get(type(child))) is not None:
            model.set_submodule(name, native(child))
    return model
