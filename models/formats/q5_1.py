"""Q5_1: 32 weights in 24 bytes: fp16 d, fp16 m, 32 fifth bits, 16 bytes of nibbles; w = d*q + m.
Panels: u8, a byte a weight with float32 scale and min (fp16 values, so exact)."""
from . import BlockFormat, bits, halves, nibbles


def decode(raw):
    q = nibbles(raw[..., 8:24]) | (bits(raw[..., 4:8]) << 4)  # [R, nb, 32], 0..31
    return q, [halves(raw, 0).float(), halves(raw, 2).float()]


FORMAT = BlockFormat("Q5_1", 32, 24, "u8", decode)
