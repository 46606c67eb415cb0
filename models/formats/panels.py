"""Panels: the layout every block format is repacked into for the CPU kernels (kernels/panel_formats.h).

A weight of N rows becomes [P, nb, bytes] uint8, P = N/8 rounded up to an even count (rows past N are
zeros), nb = K/qk: panel p holds rows 8p..8p+7, and its block b their b-th block of qk weights, as
    quants, by pairs of k, feature beside feature:
        4-bit kinds, 128 bytes: byte 16c + 2f + e = q_f[4c + e] | q_f[4c + 2 + e] << 4
        byte kinds, qk*8 bytes: byte 16j + 2f + e = q_f[2j + e]
    then each of the kind's fields, the 8 features' values side by side (fp16, fp32 or a byte each).
One extending load then gives two k of all 8 features as int16, the operand of a broadcast multiply. Each
kind computes a block's scale and min from its fields; every weight is scale*q + min.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL, PANEL_GROUP = 8, 2  # features per panel; panels per kernel tile, so P is a multiple of it
FIELD_DTYPES = {"f16": torch.float16, "f32": torch.float32, "u8": torch.uint8, "i8": torch.int8}


@dataclass(frozen=True)
class PanelKind:
    """One of panel_formats.h's structs: its number there, block length, quant layout and fields."""

    name: str
    id: int
    qk: int
    nibbles: bool
    signed: bool  # quant bytes are int8 (else unsigned)
    fields: tuple[str, ...]

    @property
    def quant_bytes(self) -> int:
        return 128 if self.nibbles else self.qk * PANEL

    @property
    def bytes(self) -> int:
        return self.quant_bytes + sum(PANEL * FIELD_DTYPES[f].itemsize for f in self.fields)

    def scale_min(self, fields: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's fields [R, nb] each -> its scale and min [R, nb] float32, as the kernel computes them."""
        f = [x.float() for x in fields]
        zero = torch.zeros_like(f[0])
        return {
            "q4": lambda: (f[0], f[1]),
            "q8": lambda: (f[0], zero),
            "q4_0": lambda: (f[0], f[0] * -8.0),
            "q4_k": lambda: (f[2] * f[0], f[3] * (f[1] * -1.0)),
            "u8": lambda: (f[0], f[1]),
            "q6_k": lambda: (f[1] * f[0], zero),
        }[self.name]()

    def dequantize(self, q: torch.Tensor, fields: list[torch.Tensor]) -> torch.Tensor:
        """quants [R, nb, qk] (this kind's bytes) and fields -> the weight [R, nb * qk] float32."""
        scale, low = self.scale_min(fields)
        values = (q.view(torch.int8) if self.signed else q).float()
        return (scale.unsqueeze(-1) * values + low.unsqueeze(-1)).reshape(q.shape[0], -1)


KINDS = {k.name: k for k in (
    PanelKind("q4", 0, 32, True, False, ("f16", "f16")),  # Q4_1: d, m
    PanelKind("q8", 1, 32, False, True, ("f16",)),  # Q8_0, Q5_0 (q - 16): d
    PanelKind("q4_0", 2, 32, True, False, ("f16",)),  # Q4_0: d, the min -8d
    PanelKind("q4_k", 3, 32, True, False, ("u8", "u8", "f16", "f16")),  # Q4_K: sc, m, d, dmin
    PanelKind("u8", 4, 32, False, False, ("f32", "f32")),  # Q5_1, Q5_K: scale, min
    PanelKind("q6_k", 5, 16, False, True, ("i8", "f16")),  # Q6_K (q - 32): sc, d
)}


def panel_count(n: int) -> int:
    return -(-n // (PANEL * PANEL_GROUP)) * PANEL_GROUP


def pack(q: torch.Tensor, fields: list[torch.Tensor], kind: PanelKind, out: torch.Tensor | None = None) -> torch.Tensor:
    """quants [R, nb, qk] uint8 (int8 bytes as uint8) and fields [R, nb] each -> panels
    [panel_count(R), nb, kind.bytes] uint8, written into `out` if given (each part straight to its place)."""
    r, nb, qk = q.shape
    assert qk == kind.qk and len(fields) == len(kind.fields), "quants and fields of this kind"
    p = panel_count(r)
    if p * PANEL != r:  # the last panels' missing rows are zeros
        q = torch.cat([q, q.new_zeros(p * PANEL - r, nb, qk)])
        fields = [torch.cat([f, f.new_zeros(p * PANEL - r, nb)]) for f in fields]
    out = torch.empty(p, nb, kind.bytes, dtype=torch.uint8) if out is None else out
    q = q.reshape(p, PANEL, nb, qk // 2, 2)  # [P, f, nb, pair, e]
    if kind.nibbles:  # pairs 2c and 2c + 1 share bytes: low and high nibble
        q = q.reshape(p, PANEL, nb, qk // 4, 2, 2)  # [P, f, nb, c, h, e]
        q = q[..., 0, :] | (q[..., 1, :] << 4)  # [P, f, nb, c, e]
    at = kind.quant_bytes
    out[..., :at].view(p, nb, -1, PANEL, 2).copy_(q.permute(0, 2, 3, 1, 4))  # [P, nb, pair (or c), f, e]
    for value, dtype in zip(fields, kind.fields):
        b = value.to(FIELD_DTYPES[dtype]).contiguous().view(torch.uint8).reshape(p, PANEL, nb, -1)  # [P, f, nb, size]
        size = b.shape[-1]
        out[..., at : at + PANEL * size].view(p, nb, PANEL, size).copy_(b.permute(0, 2, 1, 3))  # [P, nb, f, size]
        at += PANEL * size
    return out


def rows(panels: torch.Tensor, kind: PanelKind, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [R] of a weight held as panels -> [R, K] float32 (the kernels' rows_blocks)."""
    return torch.ops.kvserve_native.rows_blocks(panels, index, kind.id)
