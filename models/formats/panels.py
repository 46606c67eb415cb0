"""Panels: the layout every block format is repacked into for the CPU kernels (kernels/panel_formats.h).

A weight of N rows becomes [P, units, bytes] uint8, P = N/8 rounded up to an even count (rows past N are
zeros): panel p holds rows 8p..8p+7, in units of `sub` blocks of qk weights. Each block is
    quants, by pairs of k, feature beside feature:
        nibbles, qk*4 bytes: byte 16c + 2f + e = q_f[4c + e] | q_f[4c + 2 + e] << 4
        nibbles6 (given q - 32, held q, 0..63), qk*6 bytes: chunk c's 16 bytes at 16c, byte 2f + e =
            q_f[4c + e] | q_f[4c + 2 + e] << 6 (its low 2 bits), then at qk*4 + 16c', byte 2f + e =
            q_f[8c' + 2 + e] >> 2 | (q_f[8c' + 6 + e] >> 2) << 4 (the high 4 bits of chunks 2c', 2c' + 1)
        bytes, qk*8 bytes: byte 16j + 2f + e = q_f[2j + e]
    (MXFP4's nibbles are 4-bit codes, each standing for an integer of the kind's `values` table)
    then each of the kind's per-block fields, the 8 features' values side by side (fp16, fp32 or a byte);
and after a unit's blocks, the fields they share (a K-quant super-block's d), the same way, once.
One extending load then gives two k of all 8 features as int16, the operand of a broadcast multiply. Each
kind computes a block's scale and min from its fields; every weight is scale*q + min.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PANEL, PANEL_GROUP = 8, 2  # features per panel; panels per kernel tile, so P is a multiple of it
FIELD_DTYPES = {"f16": torch.float16, "f32": torch.float32, "u8": torch.uint8, "i8": torch.int8}
QUANT_BYTES = {"nibbles": 4, "nibbles6": 6, "bytes": 8}  # a block's quant bytes per weight of a feature


@dataclass(frozen=True)
class PanelKind:
    """One of panel_formats.h's structs: its number there, block length, quant layout and fields."""

    name: str
    id: int
    qk: int
    quants: str  # a key of QUANT_BYTES
    signed: bool  # the quants given and taken are int8 (else unsigned)
    fields: tuple[str, ...]  # each block's
    shared: tuple[str, ...] = ()  # once a unit, for its blocks
    sub: int = 1  # blocks a unit
    values: tuple[int, ...] = ()  # the integer each quant stands for, where it is a code (else itself)

    @property
    def quant_bytes(self) -> int:
        return self.qk * QUANT_BYTES[self.quants]

    @property
    def block_bytes(self) -> int:
        return self.quant_bytes + _field_bytes(self.fields)

    @property
    def bytes(self) -> int:
        """A unit's."""
        return self.sub * self.block_bytes + _field_bytes(self.shared)

    @property
    def unit(self) -> int:
        """Weights a unit, of each feature."""
        return self.qk * self.sub

    def scale_min(self, fields: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's fields [R, nb] each, then the shared ones [R, nb / sub] -> its scale and min [R, nb]
        float32, as the kernel computes them."""
        f = [x.float() if i < len(self.fields) else x.float().repeat_interleave(self.sub, dim=-1) for i, x in enumerate(fields)]
        zero = torch.zeros_like(f[0])
        return {
            "q4": lambda: (f[0], f[1]),
            "q8": lambda: (f[0], zero),
            "q4_0": lambda: (f[0], f[0] * -8.0),
            "q4_k": lambda: (f[2] * f[0], f[3] * (f[1] * -1.0)),
            "u8": lambda: (f[0], f[1]),
            "q6_k": lambda: (f[1] * f[0], zero),
            "mxfp4": lambda: (exponent_scales(fields[0]), zero),
        }[self.name]()

    def dequantize(self, q: torch.Tensor, fields: list[torch.Tensor]) -> torch.Tensor:
        """quants [R, nb, qk] (this kind's bytes) and fields -> the weight [R, nb * qk] float32."""
        scale, low = self.scale_min(fields)
        if self.values:
            values = torch.tensor(self.values, dtype=torch.float32)[q.long()]
        else:
            values = (q.view(torch.int8) if self.signed else q).float()
        return (scale.unsqueeze(-1) * values + low.unsqueeze(-1)).reshape(q.shape[0], -1)


def exponent_scales(e: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent bytes e -> 2^(e - 128) float32, as ggml_e8m0_to_fp32_half makes them: exact, e < 2 the
    denormals 2^-128 and 2^-127, and e = 255 2^127 (not a NaN, as ggml reads it)."""
    e = e.to(torch.int32)
    return torch.where(e < 2, torch.full_like(e, 0x00200000) << e, (e - 1) << 23).view(torch.float32)


# ggml's kvalues_mxfp4: the E2M1 (FP4) values doubled, so that they are integers; the scale halves them back
FP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _field_bytes(fields: tuple[str, ...]) -> int:
    return sum(PANEL * FIELD_DTYPES[f].itemsize for f in fields)


KINDS = {k.name: k for k in (
    PanelKind("q4", 0, 32, "nibbles", False, ("f16", "f16")),  # Q4_1: d, m
    PanelKind("q8", 1, 32, "bytes", True, ("f16",)),  # Q8_0, Q5_0 (q - 16): d
    PanelKind("q4_0", 2, 32, "nibbles", False, ("f16",)),  # Q4_0: d, the min -8d
    PanelKind("q4_k", 3, 32, "nibbles", False, ("u8", "u8"), ("f16", "f16"), 8),  # Q4_K: sc, m; d, dmin
    PanelKind("u8", 4, 32, "bytes", False, ("f32", "f32")),  # Q5_1, Q5_K: scale, min
    PanelKind("q6_k", 5, 16, "nibbles6", True, ("i8",), ("f16",), 16),  # Q6_K (q - 32): sc; d
    PanelKind("mxfp4", 6, 32, "nibbles", False, ("u8",), values=FP4_VALUES),  # MXFP4: FP4 codes; exponent e
)}

# Or'ed into a kind's id: its product quantizes the activations to int8 (llama.cpp's precision; int16 else).
INT8_ACTIVATIONS = 16


def panel_count(n: int) -> int:
    return -(-n // (PANEL * PANEL_GROUP)) * PANEL_GROUP


def _side_by_side(values: list[torch.Tensor], dtypes: tuple[str, ...], p: int) -> torch.Tensor:
    """Fields [P*8, n] each -> [P, n, bytes]: each field's 8 features' values side by side, field after field."""
    parts = []
    for value, dtype in zip(values, dtypes):
        b = value.to(FIELD_DTYPES[dtype]).contiguous().view(torch.uint8)  # [P*8, n * size]
        parts.append(b.reshape(p, PANEL, value.shape[1], -1).permute(0, 2, 1, 3).reshape(p, value.shape[1], -1))
    return torch.cat(parts, dim=-1)


def _quant_bytes(q: torch.Tensor, kind: PanelKind) -> torch.Tensor:
    """quants [P, f, nb, qk] -> [P, nb, kind.quant_bytes] in the kind's layout."""
    p, _, nb, qk = q.shape
    if kind.quants == "bytes":
        return q.reshape(p, PANEL, nb, qk // 2, 2).permute(0, 2, 3, 1, 4).reshape(p, nb, -1)  # [P, nb, pair, f, e]
    if kind.quants == "nibbles6":
        q = (q.view(torch.int8).to(torch.int16) + 32).to(torch.uint8)
    q = q.reshape(p, PANEL, nb, qk // 4, 2, 2).permute(0, 2, 3, 4, 1, 5)  # [P, nb, c, h, f, e]: pairs 2c, 2c + 1
    a, b = q[..., 0, :, :].reshape(p, nb, qk // 4, 16), q[..., 1, :, :].reshape(p, nb, qk // 4, 16)  # [P, nb, c, lane]
    if kind.quants == "nibbles":
        return (a | (b << 4)).reshape(p, nb, -1)
    high = (b >> 2).reshape(p, nb, qk // 8, 2, 16)  # chunks 2c and 2c + 1 share a byte
    return torch.cat([(a | (b << 6)).reshape(p, nb, -1), (high[..., 0, :] | (high[..., 1, :] << 4)).reshape(p, nb, -1)], dim=-1)


def pack(q: torch.Tensor, fields: list[torch.Tensor], kind: PanelKind, out: torch.Tensor | None = None) -> torch.Tensor:
    """quants [R, nb, qk] uint8 (int8 bytes as uint8), a block's fields [R, nb] each, then the shared ones
    [R, nb / sub] -> panels [panel_count(R), nb / sub, kind.bytes] uint8, written into `out` if given (each
    part straight to its place)."""
    r, nb, qk = q.shape
    assert qk == kind.qk and nb % kind.sub == 0 and len(fields) == len(kind.fields) + len(kind.shared), "this kind's"
    p = panel_count(r)
    if p * PANEL != r:  # the last panels' missing rows are zeros
        q = torch.cat([q, q.new_zeros(p * PANEL - r, nb, qk)])
        fields = [torch.cat([f, f.new_zeros(p * PANEL - r, f.shape[1])]) for f in fields]
    units = nb // kind.sub
    out = torch.empty(p, units, kind.bytes, dtype=torch.uint8) if out is None else out
    n = len(kind.fields)
    blocks = torch.cat([_quant_bytes(q.reshape(p, PANEL, nb, qk), kind), _side_by_side(fields[:n], kind.fields, p)], dim=-1)
    out[..., : kind.sub * kind.block_bytes].copy_(blocks.reshape(p, units, -1))  # [P, units, sub * block]
    if kind.shared:
        out[..., kind.sub * kind.block_bytes :].copy_(_side_by_side(fields[n:], kind.shared, p))
    return out


def rows(panels: torch.Tensor, kind: PanelKind, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [R] of a weight held as panels -> [R, K] float32 (the kernels' rows_blocks)."""
    return torch.ops.kvserve_native.rows_blocks(panels, index, kind.id)
