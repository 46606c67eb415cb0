"""Q4_1: 32 weights in 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles; w = d*q + m. Panels: q4."""
from . import BlockFormat, halves, nibbles


def decode(raw):
    return nibbles(raw[..., 4:20]), [halves(raw, 0), halves(raw, 2)]


FORMAT = BlockFormat("Q4_1", 32, 20, "q4", decode)
