"""Q8_0: 32 weights in 34 bytes: fp16 d, 32 int8; w = d*q. Panels: q8."""
from . import BlockFormat, halves


def decode(raw):
    return raw[..., 2:34], [halves(raw, 0)]


FORMAT = BlockFormat("Q8_0", 32, 34, "q8", decode)
