"""Mixture-of-experts feed-forward: a router, and the experts run by one functional op a layer.

    logits = router(x)                                               [n, E]
    y = kvserve::moe_experts(x, logits, top_k, routing, weights...)  [n, C]

The op picks each row's experts (moe_config.ROUTINGS), groups the rows by expert, and runs each chosen
expert once over all the rows that chose it: a step reads an expert's weights once, whatever the number of
its rows. Each product is row by row, and a row sums its experts' weighted outputs in the router's order
(as llama.cpp does), so a row's output never depends on what else shares its step: speculation relies on it.

Op contract, kvserve::moe_experts(x, logits, top_k, routing, weights, ns, kinds, gate_bias, up_bias, down_bias,
                                  swiglu_limit, swiglu_alpha):
    x [n, C], logits [n, E]
    weights  gate [E, F, C], up [E, F, C], down [E, C, F]: float (kind FLOAT, f32, f16 or bf16), or each
             expert's panels [E, P, K/unit, bytes] uint8 of a block kind (its panels.KINDS id, maybe with
             INT8_ACTIVATIONS); ns their output features (F, F, C)
    biases   None, or gate [E, F], up [E, F], down [E, C] float32 (gpt-oss): three optional tensors, not a
             list, as AOTInductor's proxy executor passes an empty list as None
    swiglu_limit 0: silu(gate) * up; > 0: gpt-oss's clamped form, (up + 1) * gate * sigmoid(alpha * gate)
             with gate clamped above and up both ways at the limit
    -> [n, C] in x's dtype (computed in float32)
A layer whose experts are all held as panels calls kvserve_native::moe_experts instead, the same contract
and the same bits (kernels/moe_experts.cpp): no Python call a layer, and every expert's products one
parallel loop.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .moe_config import ROUTINGS

FLOAT = -1  # a kind id: the weight is a float tensor


def route(logits: torch.Tensor, top_k: int, routing: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, E] -> each row's chosen experts [n, k] int64 and their weights [n, k] float32."""
    logits = logits.float()
    if routing == ROUTINGS["topk_softmax"]:
        top, ids = logits.topk(top_k, dim=-1)
        return ids, top.softmax(dim=-1)
    weights, ids = logits.softmax(dim=-1).topk(top_k, dim=-1)
    if routing == ROUTINGS["softmax_norm"]:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def _float_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, K] @ w [N, K]^T by the float kernels whose rows do not depend on m (quant.LinearF32's)."""
    if w.dtype == torch.bfloat16:
        return torch.ops.kvserve_native.linear_bf16(x, w)
    return torch.ops.kvserve_native.linear_f32(x, w.float())


def _products(x: torch.Tensor, ws: list[torch.Tensor], ns: list[int], kinds: list[int]) -> torch.Tensor:
    """x [m, K] times each of one expert's weights `ws`, their outputs side by side [m, sum(ns)]."""
    if all(k != FLOAT for k in kinds):
        return torch.ops.kvserve_native.linear_blocks(x, ws, ns, kinds)
    return torch.cat([_float_product(x, w) if k == FLOAT else torch.ops.kvserve_native.linear_blocks(x, [w], [n], [k])
                      for w, n, k in zip(ws, ns, kinds)], dim=-1)


def _activation(gate_up: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """[m, 2F] -> [m, F], row by row in the native kernel's one order (the bits of a row never depend on
    the rows or threads beside it, where F.silu's do)."""
    return torch.ops.kvserve_native.swiglu(gate_up.float(), limit, alpha)


@torch.library.custom_op("kvserve::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, logits: torch.Tensor, top_k: int, routing: int, weights: list[torch.Tensor],
                ns: list[int], kinds: list[int], gate_bias: torch.Tensor | None, up_bias: torch.Tensor | None,
                down_bias: torch.Tensor | None, swiglu_limit: float, swiglu_alpha: float) -> torch.Tensor:
    dtype, x = x.dtype, x.float()
    ids, route_weights = route(logits, top_k, routing)  # [n, k] each
    return _grouped(x, ids, route_weights, weights, ns, kinds, gate_bias, up_bias, down_bias, swiglu_limit,
                    swiglu_alpha).to(dtype)


def _grouped(x, ids, route_weights, weights, ns, kinds, gate_bias, up_bias, down_bias, swiglu_limit, swiglu_alpha):
    """The expert op on any weights: each chosen expert's products over its rows, in turn (the reference
    kernels/moe_experts.cpp computes the bits of)."""
    gate, up, down = weights
    top_k = ids.shape[1]
    flat = ids.reshape(-1)  # [n * k]: row r's choices at r*k .. r*k + k - 1
    order = flat.argsort(stable=True)  # by expert, each expert's rows ascending
    counts = torch.bincount(flat, minlength=gate.shape[0]).tolist()
    picked = torch.empty(flat.shape[0], x.shape[1], dtype=torch.float32)  # [n * k, C]: each choice's weighted output
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        chosen = order[start : start + count]  # [m] positions in flat
        start += count
        rows = chosen // top_k  # [m]
        xe = x.index_select(0, rows)  # [m, C]
        gate_up = _products(xe, [gate[e], up[e]], ns[:2], kinds[:2])  # [m, 2F]
        if gate_bias is not None:
            gate_up = gate_up + torch.cat([gate_bias[e], up_bias[e]])
        h = _activation(gate_up, swiglu_limit, swiglu_alpha)  # [m, F]
        y = _products(h, [down[e]], ns[2:], kinds[2:])  # [m, C]
        if down_bias is not None:
            y = y + down_bias[e]
        picked.index_copy_(0, chosen, y * route_weights.reshape(-1)[chosen].unsqueeze(1))
    picked = picked.view(x.shape[0], top_k, x.shape[1])  # [n, k, C]
    out = picked[:, 0]
    for j in range(1, top_k):  # one add a choice, so that a row's sum runs in one order whatever the batch
        out = out + picked[:, j]
    return out


@moe_experts.register_fake
def _(x, logits, top_k, routing, weights, ns, kinds, gate_bias, up_bias, down_bias, swiglu_limit, swiglu_alpha):
    return x.new_empty(x.shape)


class Experts(nn.Module):
    """A layer's experts: gate_proj and up_proj [E, F, C], down_proj [E, C, F], each float or panels
    (models/expert_weights.py fills them), multiplied by kvserve::moe_experts."""

    def __init__(self, n_experts: int, dim: int, ffn: int, bias: bool = False) -> None:
        super().__init__()
        self.register_buffer("gate_proj", torch.empty(n_experts, ffn, dim))
        self.register_buffer("up_proj", torch.empty(n_experts, ffn, dim))
        self.register_buffer("down_proj", torch.empty(n_experts, dim, ffn))
        if bias:
            self.register_buffer("gate_bias", torch.empty(n_experts, ffn))
            self.register_buffer("up_bias", torch.empty(n_experts, ffn))
            self.register_buffer("down_bias", torch.empty(n_experts, dim))
        self.bias = bias
        self.ns = (ffn, ffn, dim)
        self.kinds = (FLOAT, FLOAT, FLOAT)
        self.sources: tuple[str, ...] = ()  # the file's type of each weight held as panels

    def weights(self) -> list[torch.Tensor]:
        return [self.gate_proj, self.up_proj, self.down_proj]

    def biases(self) -> list[torch.Tensor | None]:
        return [self.gate_bias, self.up_bias, self.down_bias] if self.bias else [None, None, None]

    def held_blocks(self) -> list[tuple[torch.Tensor, str]]:
        """The weights held as panels, each with the file's type it came as (quant.held_types counts them)."""
        return [(w, source) for w, k, source in zip(self.weights(), self.kinds, self.sources) if k != FLOAT]


class SparseMoE(nn.Module):
    """The feed-forward of a MoE layer: router logits, then the expert op."""

    def __init__(self, config: ModelConfig, bias: bool = False, swiglu_limit: float = 0.0,
                 swiglu_alpha: float = 0.0) -> None:
        super().__init__()
        self.router = nn.Linear(config.dim, config.n_experts, bias=bias)
        self.experts = Experts(config.n_experts, config.dim, config.expert_ffn_dim, bias)
        self.top_k, self.routing = config.n_experts_used, ROUTINGS[config.routing]
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [1, n, C] -> [1, n, C]."""
        logits = self.router(x)[0]  # [n, E]
        e = self.experts
        # experts held as panels take the native op, the same contract without a Python call a layer
        op = torch.ops.kvserve.moe_experts if FLOAT in e.kinds else torch.ops.kvserve_native.moe_experts
        y = op(x[0], logits, self.top_k, self.routing, e.weights(), list(e.ns), list(e.kinds), *e.biases(),
               self.swiglu_limit, self.swiglu_alpha)  # [n, C]
        return y.unsqueeze(0)
