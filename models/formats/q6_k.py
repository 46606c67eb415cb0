"""Q6_K: 256 weights in 210 bytes: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one a
16 weights), fp16 d; w = d*sc*(q - 32). Panels: q6_k, blocks of 16, 6 bits a weight, d once a super-block."""
import torch

from . import BlockFormat, halves


def decode(raw):
    r, nb = raw.shape[:2]
    ql = raw[..., 0:128].reshape(r, nb, 2, 1, 2, 32)  # [R, nb, half, -, a, l]: bytes l and l + 32 of each half
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1, 1)) & 0x0F  # [R, nb, half, h, a, l]
    qh = raw[..., 128:192].reshape(r, nb, 2, 1, 32)  # [R, nb, half, -, l]
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [R, nb, half, group 2h + a, l]
    q = low.reshape(r, nb, 2, 4, 32) | (high << 4)  # weight 128 half + 32 group + l, 0..63
    q = (q.to(torch.int16) - 32).to(torch.int8).view(torch.uint8).reshape(r, nb * 16, 16)
    sc = raw[..., 192:208].contiguous().view(torch.int8).reshape(r, -1)
    return q, [sc, halves(raw, 208)]


FORMAT = BlockFormat("Q6_K", 256, 210, "q6_k", decode)
