"""Q5_K: 256 weights in 176 bytes: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 32 bytes of fifth
bits, 128 bytes of nibbles; w = d*sc*q - dmin*m. Panels: u8, with d*sc and -dmin*m in float32 (exact)."""
import torch

from . import BlockFormat, halves
from .q4_k import scales_and_mins


def per_block(x: torch.Tensor, blocks: int) -> torch.Tensor:
    """A super-block's field [R, nb] -> [R, nb * blocks], repeated for each of its blocks."""
    return x.repeat_interleave(blocks, dim=-1)


def decode(raw):
    r, nb = raw.shape[:2]
    qs = raw[..., 48:176].reshape(r, nb, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(r, nb, 8, 32)  # block t's nibbles
    high = (raw[..., 16:48].unsqueeze(-2) >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1  # block t: bit t of qh[l]
    q = (low | (high << 4)).reshape(r, nb * 8, 32)  # 0..31
    sc, m = scales_and_mins(raw[..., 4:16])
    d, dmin = per_block(halves(raw, 0), 8).float(), per_block(halves(raw, 2), 8).float()
    return q, [d * sc.reshape(r, -1).float(), dmin * m.reshape(r, -1).float() * -1.0]


FORMAT = BlockFormat("Q5_K", 256, 176, "u8", decode)
