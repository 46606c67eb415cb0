"""Q4_0: 32 weights in 18 bytes: fp16 d, 16 bytes of nibbles; w = d*(q - 8). Panels: q4_0, the -8d a min."""
from . import BlockFormat, halves, nibbles


def decode(raw):
    return nibbles(raw[..., 2:18]), [halves(raw, 0)]


FORMAT = BlockFormat("Q4_0", 32, 18, "q4_0", decode)
