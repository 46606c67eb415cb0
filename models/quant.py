"""Half-size weights: fp16 storage with fbgemm's fp16 x fp32 matmul (the `f16` weights mode).

Op contract, kvserve::linear_f16(x, weight, bias):
    x       [..., K] float32
    weight  [N, K]   float16
    bias    [N]      float32 or None
    returns [..., N] float32 (products and sums in float32; only the weights are rounded)
Halving the bytes read per step is the lever on a CPU whose decode is bound by memory bandwidth.
"""
from __future__ import annotations

import torch
from torch import nn

WEIGHT_MODES = ("f32", "f16")

# fbgemm packs each weight once; packing is a pure function of the weight, so this is a memo that
# nobody reads back as state: keyed by the weight's storage, alive as long as the process.
_PACKED: dict[tuple[int, tuple[int, ...]], object] = {}


def _packed(weight: torch.Tensor):
    key = (weight.data_ptr(), tuple(weight.shape))
    packed = _PACKED.get(key)
    if packed is None:
        packed = _PACKED[key] = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
    return packed


@torch.library.custom_op("kvserve::linear_f16", mutates_args=())
def linear_f16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.ops.quantized.linear_dynamic_fp16(x.reshape(-1, x.shape[-1]).float(), _packed(weight))  # [M, N]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])  # [..., N]


@linear_f16.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)


class LinearF16(nn.Module):
    """Drop-in for nn.Linear holding float16 weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(torch.float16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve.linear_f16(x, self.weight, self.bias)


def half_linears(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear with LinearF16 (a tied lm_head gets its own fp16 copy)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, LinearF16(child))
        else:
            half_linears(child)
    return model
