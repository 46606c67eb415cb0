"""Weight modes: how each nn.Linear of a built model stores its weight and which kernel multiplies it.

    f32  float32 weights, multiplied by kernels/linear_f32.cpp (kvserve_native::linear_f32), whose every
         output sums in one order whatever the batch (nn.Linear's BLAS does not; it stays where the
         AVX2 kernels do not build); the reference, parity-tested against transformers
    f16  float16 weights, fbgemm's fp16 x fp32 matmul (kvserve::linear_f16)
    q4   Q4_1 blocks for the decoder layers, Q8_0 for the lm_head (what llama.cpp's Q4_1 files hold),
         held as panels of 8 features (block_quant.py) and multiplied by the AVX2 kernel of
         kernels/quant_matmul.cpp (kvserve_native::linear_q4/q8, int16 activations) at every row count.
         The panels are the only copy of a weight. A tied embedding table then reads its rows from the
         lm_head's blocks (EmbeddingBlocks) when they hold it exactly, as a GGUF's Q8_0 token_embd does,
         so the table is not held twice either.
Everything a weight mode derives from a weight (fbgemm's packing) is held by the model, so it is freed
with the model: two engines in one process each hold their own.
Fewer bytes per weight and integer dot products are the levers at small batch. A GGUF's own Q4_1 and
Q8_0 weights requantize to the same blocks, so q4 on such a file loses nothing over f32. (A q8 mode
was measured and dropped: requantizing Q4_1 weights to Q8_0 rounds them again, and it flipped 40% of
greedy tokens on the default model while reading more bytes than q4.)

Op contract, kvserve::linear_f16(x, weight, bias):
    x [..., K] float32, weight [N, K] float16, bias [N] float32 or None -> [..., N] float32
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvcache.native import NativeUnavailable, load_native

from .block_quant import BLOCK, dequantize_panels, quantize_q4, quantize_q8, to_panels
from .errors import ModelLoadError

WEIGHT_MODES = ("f32", "f16", "q4")
_KERNELS = [Path(__file__).parent / "kernels" / name for name in ("quant_matmul.cpp", "fused.cpp", "block.cpp", "linear_f32.cpp")]


def _packed(weight: torch.Tensor):
    # fbgemm packs each weight once. The packing rides on the weight tensor itself (the same Python
    # object reaches the op on every call), so it lives exactly as long as the model holding the weight.
    packed = getattr(weight, "_fbgemm_fp16", None)
    if packed is None:
        packed = weight._fbgemm_fp16 = torch.ops.quantized.linear_prepack_fp16(weight.float(), None)
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


def load_model_kernels() -> None:
    """Build (first time) and load the kvserve_native ops (block matmuls, fused elementwise) into this process."""
    try:
        load_native("kvserve_models", _KERNELS)
    except NativeUnavailable as e:
        raise ModelLoadError(f"the q4 weight mode is unavailable here ({e}); use --weights f16 or f32") from None


def model_kernels_available() -> bool:
    try:
        load_model_kernels()
        return True
    except ModelLoadError:
        return False


class LinearF16(nn.Module):
    """Drop-in for nn.Linear holding float16 weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(torch.float16))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve.linear_f16(x, self.weight, self.bias)


class LinearF32(nn.Module):
    """Drop-in for nn.Linear whose rows' outputs do not depend on the batch (kernels/linear_f32.cpp)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.kvserve_native.linear_f32(x, self.weight)  # [..., N]
        return out if self.bias is None else out + self.bias


class LinearBlocks(nn.Module):
    """Drop-in for nn.Linear holding Q4_1 or Q8_0 blocks, as panels."""

    def __init__(self, linear: nn.Linear, fmt: str) -> None:
        super().__init__()
        self.fmt, self.out_features = fmt, linear.out_features
        quantize = quantize_q4 if fmt == "q4" else quantize_q8
        self.register_buffer("packed", to_panels(quantize(linear.weight.detach()), fmt))  # [P, K/32, panel bytes] uint8
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float(), requires_grad=False)

    def weight(self) -> torch.Tensor:
        """The weight these blocks hold, [N, K] float32."""
        return dequantize_panels(self.packed, self.fmt, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        op = torch.ops.kvserve_native.linear_q4 if self.fmt == "q4" else torch.ops.kvserve_native.linear_q8
        out = op(x, self.packed, self.out_features)  # [..., N]
        return out if self.bias is None else out + self.bias


class EmbeddingBlocks(nn.Module):
    """Drop-in for a tied nn.Embedding that reads its rows from the lm_head's Q8_0 blocks: the table is
    held once. Used only where those blocks dequantize to the table exactly (a GGUF's Q8_0 token_embd)."""

    def __init__(self, head: LinearBlocks) -> None:
        super().__init__()
        self.register_buffer("packed", head.packed)  # the head's own tensor, not a copy

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [1, n] int64 -> [1, n, dim] float32."""
        return torch.ops.kvserve_native.rows_q8(self.packed, tokens.reshape(-1)).unsqueeze(0)


def share_tied_table(model: nn.Module) -> None:
    """A tied embedding whose lm_head became Q8_0 blocks holding it exactly reads those blocks instead of
    keeping its float32 copy of the same weights."""
    head, table = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if not (isinstance(head, LinearBlocks) and head.fmt == "q8" and isinstance(table, nn.Embedding)):
        return
    if table.weight.dtype == torch.float32 and torch.equal(head.weight(), table.weight.detach()):
        model.embed_tokens = EmbeddingBlocks(head)


def convert_linears(model: nn.Module, weights: str) -> nn.Module:
    """Swap every nn.Linear for the weight mode's module (a tied lm_head gets its own copy)."""
    if weights == "f32" and not model_kernels_available():
        return model
    if weights in ("q4", "f32"):
        load_model_kernels()
    for name, child in list(model.named_modules()):
        if not isinstance(child, nn.Linear):
            continue
        if weights == "f32":
            if child.weight.dtype == torch.float32:  # bfloat16 activations keep nn.Linear
                model.set_submodule(name, LinearF32(child))
        elif weights == "f16":
            model.set_submodule(name, LinearF16(child))
        elif child.in_features % BLOCK == 0:  # rows must be whole blocks; others stay float32
            model.set_submodule(name, LinearBlocks(child, "q8" if name.split(".")[-1] == "lm_head" else "q4"))
    if weights == "q4" and getattr(getattr(model, "config", None), "tie_embeddings", False):
        share_tied_table(model)
    return model
