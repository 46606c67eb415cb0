"""Q5_0: 32 weights in 22 bytes: fp16 d, 32 fifth bits, 16 bytes of nibbles; w = d*(q - 16).
Panels: q8, the int8 q - 16 (a 5-bit weight does not unpack from pairs of bytes cheaply)."""
import torch

from . import BlockFormat, bits, halves, nibbles


def decode(raw):
    q = nibbles(raw[..., 6:22]) | (bits(raw[..., 2:6]) << 4)  # [R, nb, 32], 0..31
    return (q.to(torch.int16) - 16).to(torch.int8).view(torch.uint8), [halves(raw, 0)]


FORMAT = BlockFormat("Q5_0", 32, 22, "q8", decode)
