"""Weight modes: how each nn.Linear of a built model holds its weight, and which kernel multiplies it.

    stored  (--weights auto) every weight as its file stores it: a GGUF's block formats as panels
            (formats/), each multiplied by its own kernel of kernels/quant_matmul.cpp
            (kvserve_native::linear_blocks, int8 activations, or int16 under --activations int16);
            float weights by the float kernels
    f32     float32 weights, kernels/linear_f32.cpp (kvserve_native::linear_f32), whose every output
            sums in one order whatever the batch (nn.Linear's BLAS does not); the reference
    f16     float16 weights, fbgemm's fp16 x fp32 matmul (kvserve::linear_f16)
    q4, q4_0, q8_0   requantized when asked: Q4_1 (Q8_0 for the lm_head), Q4_0 (Q8_0 for the lm_head)
            or Q8_0 blocks, from the weights as float32
A projection whose parts a file holds in different formats (a Q4_K_M's q, k and v) is one module of
several parts, one op. A tied embedding reads its rows from the lm_head's panels (EmbeddingBlocks), so
the table is held once. Everything a weight mode derives from a weight (fbgemm's packing) is held by the
model, so it is freed with the model: two engines in one process each hold their own.

Op contract, kvserve::linear_f16(x, weight, bias):
    x [..., K] float32, weight [N, K] float16, bias [N] float32 or None -> [..., N] float32
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from kvcache.native import NativeUnavailable, load_native

from .block_quant import BLOCK, to_panels
from .errors import ModelLoadError
from .formats import FLOAT_TYPES, FORMATS
from .formats.panels import INT8_ACTIVATIONS, KINDS, PANEL, PANEL_GROUP, panel_count
from .stored import StoredTensor
from .weight_memory import empty_weight

WEIGHT_MODES = ("stored", "f32", "f16", "q4", "q4_0", "q8_0")
# How block-format products quantize their activations, per block of 32 (16 for Q6_K): int8 is llama.cpp's
# precision (its perplexity), at twice the multiply-adds an instruction, so the batched and prefill steps,
# which the multiply-adds bound, run faster; int16 keeps greedy tokens the float model's. The first is the
# default.
ACTIVATIONS = ("int8", "int16")

REQUANTIZE = {"q4": ("q4", "q8"), "q4_0": ("q4_0", "q8"), "q8_0": ("q8", "q8")}  # mode -> layers' kind, lm_head's
REQUANTIZED_TYPES = {"q4": "Q4_1", "q4_0": "Q4_0", "q8": "Q8_0"}  # a requantized kind -> the file type it equals
FLOAT_NAMES = {dtype: name for name, dtype in FLOAT_TYPES.items()}  # torch.float16 -> "F16"
_KERNELS = [Path(__file__).parent / "kernels" / name for name in ("quant_matmul.cpp", "fused.cpp", "block.cpp", "linear_f32.cpp",
                                                                  "compiled_package.cpp", "repack.cpp", "moe_experts.cpp")]


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
        raise ModelLoadError(f"the block-format kernels are unavailable here ({e}); use --weights f16 or f32") from None


def model_kernels_available() -> bool:
    try:
        load_model_kernels()
        return True
    except ModelLoadError:
        return False


def _bias(linear: nn.Linear | None) -> nn.Parameter | None:
    if linear is None or linear.bias is None:
        return None
    return nn.Parameter(linear.bias.detach().float(), requires_grad=False)


class LinearF16(nn.Module):
    """Drop-in for nn.Linear holding float16 weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(torch.float16))
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvserve.linear_f16(x, self.weight, self.bias)


class LinearF32(nn.Module):
    """Drop-in for nn.Linear whose rows' outputs do not depend on the batch (kernels/linear_f32.cpp)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.kvserve_native.linear_f32(x, self.weight)  # [..., N]
        return out if self.bias is None else out + self.bias


class LinearBF16(nn.Module):
    """Drop-in for nn.Linear holding bfloat16 weights as stored (kernels/linear_f32.cpp)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight", linear.weight.detach().to(torch.bfloat16))
        self.bias = _bias(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.kvserve_native.linear_bf16(x, self.weight)  # [..., N]
        return out if self.bias is None else out + self.bias


class LinearBlocks(nn.Module):
    """Drop-in for nn.Linear holding block-format weights as panels: one or more parts, each of its own
    kind and rows, whose outputs sit side by side."""

    def __init__(self, parts: list[tuple[torch.Tensor, str, int]], bias: torch.Tensor | None = None,
                 sources: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.kinds = tuple(kind for _, kind, _ in parts)
        self.ns = tuple(n for _, _, n in parts)
        self.kind_ids = tuple(KINDS[kind].id for kind in self.kinds)
        self.out_features = sum(self.ns)
        self.sources = sources  # the file's type of each tensor this projection holds
        for i, (panels, _, _) in enumerate(parts):
            self.register_buffer("packed" if i == 0 else f"packed_{i}", panels)  # [P, K/qk, panel bytes] uint8
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @property
    def fmt(self) -> str:
        """The kind of a one-part projection (mixed ones are "mixed")."""
        return self.kinds[0] if len(self.kinds) == 1 else "mixed"

    def panels(self) -> list[torch.Tensor]:
        return [getattr(self, "packed" if i == 0 else f"packed_{i}") for i in range(len(self.kinds))]

    @staticmethod
    def quantized(linear: nn.Linear, kind: str) -> LinearBlocks:
        """An nn.Linear's weight requantized to `kind` (q4, q4_0, q8)."""
        name = REQUANTIZED_TYPES[kind]
        return LinearBlocks([(to_panels(linear.weight.detach(), kind), kind, linear.out_features)], linear.bias, (name,))

    @staticmethod
    def from_stored(tensors: list[StoredTensor], bias: torch.Tensor | None) -> LinearBlocks:
        """Tensors of a GGUF, stacked by rows -> their panels, as stored. Neighbours of one format whose
        rows fill whole panel groups share one part."""
        runs: list[tuple[list[StoredTensor], str]] = []  # each part's tensors, kind
        for t in tensors:
            t.check_type()
            kind = FORMATS[t.type].kind_name
            if runs and runs[-1][1] == kind and sum(r.rows for r in runs[-1][0]) % (PANEL * PANEL_GROUP) == 0:
                runs[-1][0].append(t)
            else:
                runs.append(([t], kind))
        parts = []
        for run, kind in runs:  # each tensor's panels written straight into its part's place
            rows = sum(t.rows for t in run)
            out = empty_weight((panel_count(rows), run[0].shape[-1] // KINDS[kind].unit, KINDS[kind].bytes))
            at = 0
            for t in run:
                t.panels(out[at : at + panel_count(t.rows)])
                at += panel_count(t.rows)
            parts.append((out, kind, rows))
        return LinearBlocks(parts, bias, tuple(t.type for t in tensors))

    def weight(self) -> torch.Tensor:
        """The weight these blocks hold, [N, K] float32."""
        return torch.cat([torch.ops.kvserve_native.rows_blocks(p, torch.arange(n), KINDS[k].id)
                          for p, k, n in zip(self.panels(), self.kinds, self.ns)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.kvserve_native.linear_blocks(x, self.panels(), self.ns, self.kind_ids)  # [..., N]
        return out if self.bias is None else out + self.bias


class EmbeddingBlocks(nn.Module):
    """Drop-in for nn.Embedding that reads its rows from a one-part LinearBlocks' panels: a tied table
    is held once, and an untied one as stored."""

    def __init__(self, table: LinearBlocks) -> None:
        super().__init__()
        assert len(table.kinds) == 1, "an embedding table is one tensor"
        self.kind_id = table.kind_ids[0]
        self.sources = table.sources
        self.register_buffer("packed", table.packed)  # the table's own tensor, not a copy

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [1, n] int64 -> [1, n, dim] float32."""
        return torch.ops.kvserve_native.rows_blocks(self.packed, tokens.reshape(-1), self.kind_id).unsqueeze(0)


class EmbeddingFloat(nn.Module):
    """Drop-in for nn.Embedding over a float16 or bfloat16 table, as stored: rows widen to float32 as read."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight.detach())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(tokens, self.weight).float()  # [1, n, dim]


def held_types(model: nn.Module) -> tuple[tuple[str, int], ...]:
    """What a built model holds, by tensor type: the file's type of each matrix it keeps as blocks, the
    dtype of each float tensor, most first."""
    counts: dict[str, int] = {}
    tables = {m.packed.data_ptr(): m.sources for m in model.modules() if isinstance(m, (LinearBlocks, EmbeddingBlocks))}
    # (a MoE layer's experts: each of its block-format weights, moe.Experts.held_blocks)
    tables.update({t.data_ptr(): (source,) for m in model.modules() if hasattr(m, "held_blocks")
                   for t, source in m.held_blocks()})
    names = [t for sources in tables.values() for t in sources]  # a tied table once, with its lm_head
    seen = set(tables)
    for t in model.state_dict(keep_vars=True).values():
        if t is not None and t.is_floating_point() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            names.append(FLOAT_NAMES.get(t.dtype, str(t.dtype)))
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return tuple(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def share_tied_table(model: nn.Module) -> None:
    """A tied embedding whose lm_head became one-part blocks holding it exactly reads those blocks instead
    of keeping its float32 copy of the same weights."""
    head, table = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    if not (isinstance(head, LinearBlocks) and len(head.kinds) == 1 and isinstance(table, nn.Embedding)):
        return
    if table.weight.dtype == torch.float32 and torch.equal(head.weight(), table.weight.detach()):
        model.embed_tokens = EmbeddingBlocks(head)


def _float_module(linear: nn.Linear) -> nn.Module:
    """A float weight as it is: float32, float16 or bfloat16."""
    kind = {torch.float16: LinearF16, torch.bfloat16: LinearBF16}.get(linear.weight.dtype, LinearF32)
    return kind(linear)


def quantize_activations(model: nn.Module, activations: str) -> None:
    """Every block-format product of the model quantizes its activations as `activations` says."""
    if activations == "int8":
        for module in model.modules():
            if isinstance(module, LinearBlocks):
                module.kind_ids = tuple(k | INT8_ACTIVATIONS for k in module.kind_ids)


def convert_linears(model: nn.Module, weights: str) -> nn.Module:
    """Swap every float nn.Linear for the weight mode's module (a tied lm_head gets its own copy)."""
    if weights in ("f32", "stored") and not model_kernels_available():
        return model
    if weights != "f16":
        load_model_kernels()
    for name, child in list(model.named_modules()):
        if not isinstance(child, nn.Linear):
            continue
        if weights == "stored":
            model.set_submodule(name, _float_module(child))
        elif weights == "f32":
            if child.weight.dtype == torch.float32:  # bfloat16 activations keep nn.Linear
                model.set_submodule(name, LinearF32(child))
        elif weights == "f16":
            model.set_submodule(name, LinearF16(child))
        elif child.in_features % BLOCK == 0:  # rows must be whole blocks; others stay float32
            layers, head = REQUANTIZE[weights]
            model.set_submodule(name, LinearBlocks.quantized(child, head if name.split(".")[-1] == "lm_head" else layers))
    if weights in REQUANTIZE and getattr(getattr(model, "config", None), "tie_embeddings", False):
        share_tied_table(model)
    return model
