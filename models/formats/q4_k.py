"""Q4_K: 256 weights in 144 bytes: fp16 d and dmin, 12 bytes of 6-bit scales and mins for 8 blocks of
32, 128 bytes of nibbles; w = d*sc*q - dmin*m. Panels: q4_k, the 6-bit pair a byte each, d and dmin once a super-block."""
import torch

from . import BlockFormat, halves


def scales_and_mins(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of K-quant scales [R, nb, 12] -> (sc, m) [R, nb, 8] each, 0..63 (ggml's get_scale_min_k4)."""
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    m = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, m


def decode(raw):
    r, nb = raw.shape[:2]
    qs = raw[..., 16:144].reshape(r, nb, 4, 32)  # 4 chunks of 64 weights: low nibbles, then high
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(r, nb * 8, 32)  # [R, blocks, 32]
    sc, m = scales_and_mins(raw[..., 4:16])
    return q, [sc.reshape(r, -1), m.reshape(r, -1), halves(raw, 0), halves(raw, 2)]


FORMAT = BlockFormat("Q4_K", 256, 144, "q4_k", decode)
