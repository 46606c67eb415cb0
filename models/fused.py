"""Native (C++/AVX2) stand-ins for the decoder's modules, swapped in for the fast weight modes.

Each replaces a module of llama.py with kvserve_native ops computing the same float32 math, so a
layer dispatches ~12 ops instead of ~45, and a q4 decoder one op a step for all its layers (at batch 1
each dispatch rivals a small matmul).
"""
from __future__ import annotations

import torch
from torch import nn

from .llama import Block, Layers, QKVRotary, RMSNorm, SwiGLU
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


class NativeDecoder(nn.Module):
    """The decoder's Layers, every projection q4: one kvserve_native::decoder_q4 call a step, which runs
    each layer's attention through kvcache::update_and_attend (models/kernels/block.cpp)."""

    KINDS = ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")  # the order decoder_q4 takes them

    def __init__(self, layers: Layers) -> None:
        super().__init__()
        first = layers[0]
        self.head_dim = first.self_attn.head_dim
        self.n_heads, self.n_kv_heads = first.self_attn.rotary.n_heads, first.self_attn.rotary.n_kv_heads
        self.eps = first.input_layernorm.eps
        # Each kind's weights of every layer as one buffer [L, ...] (export lifts it, the artifact stores it
        # once): the op takes six tensors a step, not six a layer. A list of 180 cost more to hand over
        # than the call's own work, and each tensor released after it took the GIL back once.
        per_layer = []
        for i, b in enumerate(layers):
            assert b.self_attn.layer_id == i, "layers run in the order of their ids"
            attn, mlp = b.self_attn, b.mlp
            per_layer.append((b.input_layernorm.weight, attn.qkv_proj.packed, attn.o_proj.packed,
                              b.post_attention_layernorm.weight, mlp.gate_up_proj.packed, mlp.down_proj.packed))
        for kind, tensors in zip(self.KINDS, zip(*per_layer)):
            self.register_buffer(kind, torch.stack([t.detach() for t in tensors]))
        biases = [b.self_attn.qkv_proj.bias for b in layers]
        self.register_buffer("qkv_bias", None if biases[0] is None else torch.stack([b.detach() for b in biases]))

    @staticmethod
    def fits(layers: nn.Module) -> bool:
        """Layers whose blocks are alike: q4 projections, the attention's without bias but for qkv (in all
        or none), one norm eps."""
        if not isinstance(layers, Layers) or len(layers) == 0 or not all(isinstance(b, Block) for b in layers):
            return False
        first = layers[0]
        eps, heads = first.input_layernorm.eps, (first.self_attn.rotary.n_heads, first.self_attn.rotary.n_kv_heads)
        biased = first.self_attn.qkv_proj.bias is not None
        for block in layers:
            attn, mlp = block.self_attn, block.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not (all(isinstance(m, LinearBlocks) and m.fmt == "q4" for m in linears)
                    and all(m.bias is None for m in linears[1:]) and (attn.qkv_proj.bias is not None) == biased
                    and block.input_layernorm.eps == block.post_attention_layernorm.eps == eps
                    and (attn.rotary.n_heads, attn.rotary.n_kv_heads) == heads and attn.head_dim == first.self_attn.head_dim):
                return False
        return True

    def forward(self, x, positions, cos, sin):
        return torch.ops.kvserve_native.decoder_q4(
            x, positions, cos, sin, *(getattr(self, kind) for kind in self.KINDS), self.qkv_bias,
            self.n_heads, self.n_kv_heads, self.eps, self.head_dim**-0.5,
        )


_NATIVE = {RMSNorm: NativeRMSNorm, QKVRotary: NativeQKVRotary, SwiGLU: lambda _: NativeSwiGLU()}


def use_native_modules(model: nn.Module) -> nn.Module:
    """Swap q4 Layers for NativeDecoder, and elsewhere RMSNorm, QKVRotary and SwiGLU for their native ops
    (float32 models; kernels loaded)."""
    swapped: list[str] = []
    for name, child in list(model.named_modules()):
        if not name or any(name.startswith(prefix + ".") for prefix in swapped):
            continue
        if NativeDecoder.fits(child):
            model.set_submodule(name, NativeDecoder(child))
            swapped.append(name)
        elif (native := _NATIVE.get(type(child))) is not None:
            model.set_submodule(name, native(child))
    return model
