"""llama.cpp's Q4_1 and Q8_0 block formats as uint8 tensors: quantize and dequantize in torch.

Layout contract, per weight row of K values (K a multiple of 32, nb = K/32 blocks), fields as arrays:
    Q4_1, 20 bytes a block: nb*16 bytes of nibbles (byte j of a block = q[j] | q[j + 16] << 4),
          then nb fp16 scales d, then nb fp16 mins m; w = d*q + m
    Q8_0, 34 bytes a block: nb*32 int8 q, then nb fp16 scales d; w = d*q
(llama.cpp interleaves each block's fields.)
Quantizing rounds with the fp16 scale actually stored, so a tensor dequantized from these formats
(a GGUF's Q4_1/Q8_0 weights) quantizes back to the same blocks.

Panels, the layout the kernels read (kernels/quant_matmul.cpp): the same blocks, regrouped so that 8
output features sit side by side. A weight of N rows becomes [P, nb, panel block] uint8, P = N/8 rounded
up to an even count (rows past N are zeros); panel p holds rows 8p..8p+7, and its block b holds their
block b: the quants by pairs of k, feature beside feature, then 8 fp16 scales (then 8 fp16 mins).
    Q4_1, 160 bytes: 128 bytes of nibbles, byte 16c + 2f + e = q_f[4c + e] | q_f[4c + 2 + e] << 4,
          then d_0..d_7, then m_0..m_7
    Q8_0, 272 bytes: 256 int8, byte 16j + 2f + e = q_f[2j + e], then d_0..d_7
One extending load then gives two k of all 8 features as int16, the operand of a broadcast multiply, and
the same bytes per weight are read as from the row layout. They are the only copy a model holds.
"""
from __future__ import annotations

import torch

BLOCK = 32
BYTES_PER_BLOCK = {"q4": 20, "q8": 34}
PANEL, PANEL_GROUP = 8, 2  # features per panel; panels per kernel tile, so P is a multiple of it
PANEL_QUANT_BYTES = {"q4": 128, "q8": 256}  # of a panel block, before its scales (and mins)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """[N, nb] float16 -> [N, nb, 2] uint8 (little-endian, as the kernels read it)."""
    return x.contiguous().unsqueeze(-1).view(torch.uint8)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"block quantization needs a row length divisible by {BLOCK}, got {k}")
    return w.float().reshape(n, k // BLOCK, BLOCK)  # [N, nb, 32]


def quantize_q4(w: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K/32 * 20] uint8 (Q4_1)."""
    b = _blocks(w)
    lo, hi = b.amin(-1), b.amax(-1)  # [N, nb]
    d = ((hi - lo) / 15).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = ((b - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)  # [N, nb, 32]
    nibbles = q[..., :16] | (q[..., 16:] << 4)  # [N, nb, 16]
    n = w.shape[0]
    return torch.cat([nibbles.reshape(n, -1), _as_bytes(d).reshape(n, -1), _as_bytes(m).reshape(n, -1)], dim=-1)


def quantize_q8(w: torch.Tensor) -> torch.Tensor:
    """[N, K] float -> [N, K/32 * 34] uint8 (Q8_0)."""
    b = _blocks(w)
    d = (b.abs().amax(-1) / 127).half()  # [N, nb]
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = (b * inv.unsqueeze(-1)).round().clamp(-127, 127).to(torch.int8)  # [N, nb, 32]
    n = w.shape[0]
    return torch.cat([q.view(torch.uint8).reshape(n, -1), _as_bytes(d).reshape(n, -1)], dim=-1)


def dequantize(packed: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, K/32 * bytes] uint8 -> [N, K] float32."""
    n = packed.shape[0]
    nb = packed.shape[1] // BYTES_PER_BLOCK[fmt]
    quant = 16 if fmt == "q4" else 32
    d = packed[:, nb * quant : nb * (quant + 2)].contiguous().view(torch.float16).float().unsqueeze(-1)  # [N, nb, 1]
    if fmt == "q8":
        q = packed[:, : nb * 32].contiguous().view(torch.int8).float().reshape(n, nb, 32)  # [N, nb, 32]
        return (d * q).reshape(n, -1)
    m = packed[:, nb * 18 :].contiguous().view(torch.float16).float().unsqueeze(-1)  # [N, nb, 1]
    nib = packed[:, : nb * 16].reshape(n, nb, 16)  # [N, nb, 16]
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).float()  # [N, nb, 32]
    return (d * q + m).reshape(n, -1)


def panel_count(n: int) -> int:
    return -(-n // (PANEL * PANEL_GROUP)) * PANEL_GROUP


def _fields(rows: torch.Tensor, fmt: str, nb: int):
    """[R, nb * bytes] rows -> quants [R, nb, 32] (k order, unsigned nibbles or int8 bytes), scales (and
    mins) [R, nb, 2] as bytes."""
    r = rows.shape[0]
    if fmt == "q8":
        return rows[:, : nb * 32].reshape(r, nb, 32), [rows[:, nb * 32 :].reshape(r, nb, 2)]
    nib = rows[:, : nb * 16].reshape(r, nb, 16)
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1)  # [R, nb, 32]
    return q, [rows[:, nb * 16 : nb * 18].reshape(r, nb, 2), rows[:, nb * 18 :].reshape(r, nb, 2)]


def to_panels(rows: torch.Tensor, fmt: str) -> torch.Tensor:
    """[N, K/32 * block bytes] uint8 rows (quantize_q4/q8) -> [P, K/32, 160 (q4) or 272 (q8)] uint8 panels."""
    n, nb = rows.shape[0], rows.shape[1] // BYTES_PER_BLOCK[fmt]
    p = panel_count(n)
    padded = torch.zeros(p * PANEL, rows.shape[1], dtype=torch.uint8)
    padded[:n] = rows
    q, scales = _fields(padded, fmt, nb)
    q = q.reshape(p, PANEL, nb, 16, 2)  # [P, f, nb, pair, e]
    if fmt == "q4":  # pairs 2c and 2c + 1 share bytes: low and high nibble
        q = q.reshape(p, PANEL, nb, 8, 2, 2)  # [P, f, nb, c, h, e]
        q = q[..., 0, :] | (q[..., 1, :] << 4)  # [P, f, nb, c, e]
    quants = q.permute(0, 2, 3, 1, 4).reshape(p, nb, -1)  # [P, nb, pair (or c), f, e]
    fields = [s.reshape(p, PANEL, nb, 2).permute(0, 2, 1, 3).reshape(p, nb, 2 * PANEL) for s in scales]
    return torch.cat([quants, *fields], dim=-1).contiguous()


def panel_rows(panels: torch.Tensor, fmt: str, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` [R] of a weight held as panels -> [R, K/32 * block bytes] uint8, as quantize_q4/q8 gives."""
    nb, r = panels.shape[1], index.shape[0]
    sel = panels.index_select(0, torch.div(index, PANEL, rounding_mode="floor"))  # [R, nb, panel bytes]
    f = torch.remainder(index, PANEL)
    quant_bytes = PANEL_QUANT_BYTES[fmt]
    q = sel[:, :, :quant_bytes].reshape(r, nb, -1, PANEL, 2).permute(0, 3, 1, 2, 4)  # [R, f, nb, pair (or c), e]
    q = q[torch.arange(r), f]  # [R, nb, pair (or c), e]
    scales = sel[:, :, quant_bytes:].reshape(r, nb, -1, PANEL, 2).permute(0, 3, 2, 1, 4)[torch.arange(r), f]  # [R, fields, nb, 2]
    if fmt == "q4":
        q = torch.stack([q & 0x0F, q >> 4], dim=-2).reshape(r, nb, 32)  # [R, nb, c, h, e] -> k order
        quants = q[..., :16] | (q[..., 16:] << 4)  # the row layout's nibbles: byte j = q[j] | q[j + 16] << 4
    else:
        quants = q.reshape(r, nb, 32)
    return torch.cat([quants.reshape(r, -1), *[s.reshape(r, -1) for s in scales.unbind(1)]], dim=-1)


def dequantize_panels(panels: torch.Tensor, fmt: str, n: int) -> torch.Tensor:
    """[P, nb, panel bytes] uint8 -> the weight [n, K] float32."""
    return dequantize(panel_rows(panels, fmt, torch.arange(n)), fmt)
