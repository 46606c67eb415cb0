"""MXFP4 (gpt-oss's experts): 32 weights in 17 bytes: an E8M0 exponent byte e, then 16 bytes of 4-bit E2M1
codes (low nibbles first, as Q4_0's); w = 2^(e - 128) * value, the value a code's entry of ggml's
kvalues_mxfp4 (the FP4 value doubled, -12..12). Panels: mxfp4, the codes as stored, 4 bits a weight (the
kernels map them to their values), and e as its byte."""
from . import BlockFormat, nibbles


def decode(raw):
    return nibbles(raw[..., 1:17]), [raw[..., 0]]


FORMAT = BlockFormat("MXFP4", 32, 17, "mxfp4", decode)
