"""A MoE checkpoint's expert weights into its layers' Experts (moe.py): stacked from a folder's one tensor an
expert, or taken from a GGUF's one 3-D tensor a projection, and held as the weight mode says: as stored, a
file's blocks become each expert's panels, read an expert at a time, so a load never holds a layer twice."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .block_quant import BLOCK, to_panels
from .config import ModelConfig
from .errors import ModelLoadError
from .formats import FLOAT_TYPES, FORMATS
from .formats.panels import INT8_ACTIVATIONS, KINDS, PANEL, PANEL_GROUP, panel_count
from .moe import FLOAT, SparseMoE
from .quant import REQUANTIZE, REQUANTIZED_TYPES
from .stored import StoredTensor
from .weight_memory import empty_weight

PARTS = ("gate_proj", "up_proj", "down_proj")
BIASES = ("gate_bias", "up_bias", "down_bias")
Weight = torch.Tensor | StoredTensor


def take_experts(state: dict, config: ModelConfig) -> tuple[dict, dict[str, Weight]]:
    """The experts' weights out of a checkpoint's state -> (the rest, `layers.L.mlp.experts.<part>` -> [E, N, K]).
    A folder's `mlp.gate` (the router) becomes `mlp.router`; its experts, one tensor each, are stacked."""
    if not config.n_experts:
        return state, {}
    state, experts = dict(state), {}
    for i in range(config.n_layers):
        mlp = f"layers.{i}.mlp"
        if f"{mlp}.gate.weight" in state:
            state[f"{mlp}.router.weight"] = state.pop(f"{mlp}.gate.weight")
        if f"{mlp}.experts.gate_up_proj" in state:
            experts.update(_fused_experts(state, f"{mlp}.experts", config.architecture))
        for part in PARTS:
            keys = [f"{mlp}.experts.{e}.{part}.weight" for e in range(config.n_experts)]
            if all(k in state for k in keys):
                experts[f"{mlp}.experts.{part}"] = torch.stack([state.pop(k) for k in keys])  # [E, N, K]
            elif f"{mlp}.experts.{part}" in state:
                experts[f"{mlp}.experts.{part}"] = state.pop(f"{mlp}.experts.{part}")
        for part in BIASES:
            if f"{mlp}.experts.{part}" in state:
                experts[f"{mlp}.experts.{part}"] = state.pop(f"{mlp}.experts.{part}")
    return state, experts


def _fused_experts(state: dict, prefix: str, arch: str) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors -> ours. gpt-oss's folders hold gate_up_proj [E, C, 2F], gate and up
    columns interleaved, down_proj [E, F, C] (each multiplied from the right), and their biases; elsewhere
    gate_up_proj is [E, 2F, C], gate rows first."""
    fused = state.pop(f"{prefix}.gate_up_proj")
    if arch != "gpt-oss":
        gate, up = fused.chunk(2, dim=1)
        return {f"{prefix}.gate_proj": gate, f"{prefix}.up_proj": up}
    out = {f"{prefix}.gate_proj": fused[..., 0::2].transpose(1, 2).contiguous(),
           f"{prefix}.up_proj": fused[..., 1::2].transpose(1, 2).contiguous(),
           f"{prefix}.down_proj": state.pop(f"{prefix}.down_proj").transpose(1, 2).contiguous()}
    bias = state.pop(f"{prefix}.gate_up_proj_bias", None)
    if bias is not None:
        out[f"{prefix}.gate_bias"], out[f"{prefix}.up_bias"] = bias[..., 0::2].contiguous(), bias[..., 1::2].contiguous()
    if f"{prefix}.down_proj_bias" in state:
        out[f"{prefix}.down_bias"] = state.pop(f"{prefix}.down_proj_bias")
    return out


def expert_view(w: StoredTensor, e: int) -> StoredTensor:
    """Expert e's matrix [N, K] of a stored [E, N, K]: its rows follow the previous expert's."""
    n, k = w.shape[1:]
    return dataclasses.replace(w, name=f"{w.name}[{e}]", offset=w.offset + e * n * w.row_bytes, shape=(n, k))


def _stored_panels(w: StoredTensor) -> tuple[torch.Tensor, int]:
    """A stored block-format [E, N, K] -> each expert's panels [E, P, K/unit, bytes], and their kind's id."""
    w.check_type()
    kind = KINDS[FORMATS[w.type].kind_name]
    e, n, k = w.shape
    out = empty_weight((e, panel_count(n), k // kind.unit, kind.bytes))
    if n % (PANEL * PANEL_GROUP) == 0:  # no padding rows: the experts' panels follow each other as their rows do
        dataclasses.replace(w, shape=(e * n, k)).panels(out.view(-1, *out.shape[2:]))
        return out, kind.id
    for i in range(e):
        expert_view(w, i).panels(out[i])
    return out, kind.id


def _floats(w: Weight) -> torch.Tensor:
    """[E, N, K] as float: a stored float type as it is, a block type dequantized an expert at a time."""
    if isinstance(w, torch.Tensor):
        return w
    w.check_type()
    views = [expert_view(w, i) for i in range(w.shape[0])]
    return torch.stack([v.floats() if w.is_float else v.dequantize() for v in views])


def held(w: Weight, weights: str) -> tuple[torch.Tensor, int, str]:
    """One expert weight [E, N, K] as the weight mode holds it -> (tensor, kind id, the type it came as)."""
    if weights == "stored" and isinstance(w, StoredTensor) and not w.is_float:
        panels, kind = _stored_panels(w)
        return panels, kind, w.type
    source = w.type if isinstance(w, StoredTensor) else None
    floats = _floats(w)
    if weights in REQUANTIZE:
        if floats.shape[-1] % BLOCK:
            raise ModelLoadError(f"expert rows of {floats.shape[-1]} weights are not whole blocks of {BLOCK}")
        kind = REQUANTIZE[weights][0]  # the layers' kind
        return torch.stack([to_panels(m.float(), kind) for m in floats]), KINDS[kind].id, REQUANTIZED_TYPES[kind]
    if weights == "f16":
        floats = floats.to(torch.float16)
    elif weights == "f32" or floats.dtype not in FLOAT_TYPES.values():
        floats = floats.float()
    return floats.contiguous(), FLOAT, source or str(floats.dtype).removeprefix("torch.")


def assign_experts(model: nn.Module, experts: dict[str, Weight], weights: str, activations: str) -> None:
    """Every MoE layer's expert weights, checked against its shapes, held as the weight mode says; block
    kinds multiply int8 activations where `activations` says so."""
    for name, module in model.named_modules():
        if not isinstance(module, SparseMoE):
            continue
        e = module.experts
        kinds, sources = [], []
        for part, expected in zip(PARTS, e.weights()):
            key = f"{name}.experts.{part}"
            if key not in experts:
                raise ModelLoadError(f"checkpoint does not fit the model: missing {key}")
            w = experts.pop(key)
            if tuple(w.shape) != tuple(expected.shape):
                raise ModelLoadError(f"weight {key} has shape {tuple(w.shape)}, expected {tuple(expected.shape)}")
            tensor, kind, source = held(w, weights)
            e.register_buffer(part, tensor)
            kinds.append(kind | INT8_ACTIVATIONS if kind != FLOAT and activations == "int8" else kind)
            sources.append(source)
        e.kinds, e.sources = tuple(kinds), tuple(sources)
        for part, expected in zip(BIASES, e.biases() if e.bias else []):
            b = experts.pop(f"{name}.experts.{part}", None)
            if b is None or tuple(b.shape) != tuple(expected.shape):
                raise ModelLoadError(f"weight {name}.experts.{part} is missing or not of shape {tuple(expected.shape)}")
            e.register_buffer(part, (b.floats() if isinstance(b, StoredTensor) else b).float().contiguous())
    if experts:
        raise ModelLoadError(f"checkpoint does not fit the model: unexpected {sorted(experts)[:5]}")
