"""llama.cpp's Q4_1 and Q8_0 block formats as uint8 tensors: quantize and dequantize in torch.

Layout contract, per weight row of K values (K a multiple of 32, nb = K/32 blocks), fields as arrays:
    Q4_1, 20 bytes a block: nb*16 bytes of nibbles (byte j of a block = q[j] | q[j + 16] << 4),
          then nb fp16 scales d, then nb fp16 mins m; w = d*q + m
    Q8_0, 34 bytes a block: nb*32 int8 q, then nb fp16 scales d; w = d*q
(llama.cpp interleaves each block's fields; arrays let the kernels load four scales at once.)
Quantizing rounds with the fp16 scale actually stored, so a tensor dequantized from these formats
(a GGUF's Q4_1/Q8_0 weights) quantizes back to the same blocks.
"""
from __future__ import annotations

import torch

BLOCK = 32
BYTES_PER_BLOCK = {"q4": 20, "q8": 34}


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
