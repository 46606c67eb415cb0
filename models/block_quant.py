"""Requantizing, when asked (--weights q4, q4_0, q8_0): a float weight -> llama.cpp's Q4_1, Q4_0 or
Q8_0 blocks, decoded as their panel kind's quants and fields (formats/panels.py).

    Q4_1 (kind q4):   per block of 32, d = (max - min)/15, m = min; q = round((w - m)/d), 0..15
    Q4_0 (kind q4_0): d = v/-8, v the value of largest magnitude; q = trunc(w/d + 8.5), 0..15
    Q8_0 (kind q8):   d = amax/127; q = round(w/d), -127..127
Each rounds with the fp16 scale actually stored, so a weight dequantized from these formats (a GGUF's
Q4_1, Q4_0 or Q8_0 tensor) quantizes back to the same blocks.
"""
from __future__ import annotations

import torch

from .formats.panels import KINDS, pack

BLOCK = 32
REQUANT_KINDS = ("q4", "q4_0", "q8")


def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"block quantization needs a row length divisible by {BLOCK}, got {k}")
    return w.float().reshape(n, k // BLOCK, BLOCK)  # [N, nb, 32]


def _inverse(d: torch.Tensor) -> torch.Tensor:
    d = d.float()
    return torch.where(d != 0, 1 / d, torch.zeros_like(d)).unsqueeze(-1)


def quantize(w: torch.Tensor, kind: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """[N, K] float -> (quants [N, K/32, 32] uint8, fields [N, K/32] each) of a REQUANT_KINDS kind."""
    b = _blocks(w)
    if kind == "q4":
        lo, hi = b.amin(-1), b.amax(-1)  # [N, nb]
        d, m = ((hi - lo) / 15).half(), lo.half()
        q = ((b - m.float().unsqueeze(-1)) * _inverse(d)).round().clamp(0, 15)
        return q.to(torch.uint8), [d, m]
    if kind == "q4_0":
        at = b.abs().argmax(-1, keepdim=True)
        d = (b.gather(-1, at).squeeze(-1) / -8).half()
        q = (b * _inverse(d) + 8.5).trunc().clamp(0, 15)
        return q.to(torch.uint8), [d]
    if kind == "q8":
        d = (b.abs().amax(-1) / 127).half()
        q = (b * _inverse(d)).round().clamp(-127, 127)
        return q.to(torch.int8).view(torch.uint8), [d]
    raise ValueError(f"cannot requantize to {kind!r}; choose one of {', '.join(REQUANT_KINDS)}")


def dequantize(q: torch.Tensor, fields: list[torch.Tensor], kind: str) -> torch.Tensor:
    """What quantize gives -> the weight [N, K] float32."""
    return KINDS[kind].dequantize(q, fields)


def to_panels(w: torch.Tensor, kind: str) -> torch.Tensor:
    """[N, K] float -> its blocks of `kind` as panels [P, K/32, bytes] uint8."""
    return pack(*quantize(w, kind), KINDS[kind])
