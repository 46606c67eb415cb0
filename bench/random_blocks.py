"""Tensors of random blocks, in any stored GGUF type, streamed into a gguf-py writer a chunk at a time: no
float copy of a tensor, no quantizer, and a writer that holds tens of MiB whatever the file's size.

Every block is random bytes with its scale fields set so that the block's values have the RMS asked for
(moe_files.py asks 1/sqrt(row length), which keeps a forward pass finite through all the layers) and,
as a quantizer's, average zero."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

CHUNK_BYTES = 32 << 20  # what one write generates; bounds the writer's memory
# A block's fp16 scale fields: (byte offset, value relative to the first). Q4_K's min scale is 7.5 times its
# scale, the mean of its 4-bit quants, so that a block's values average zero.
FP16_SCALES = {"Q4_K": ((0, 1.0), (2, 7.5)), "Q6_K": ((208, 1.0),), "Q8_0": ((0, 1.0),)}
SUPPORTED = ("F32", "MXFP4", *FP16_SCALES)


@dataclass(frozen=True)
class TensorPlan:
    """One tensor: its GGUF name, shape (outermost first, as numpy; GGUF's ne reversed), stored type, and
    the values it holds: center + std * noise for F32, blocks whose values have RMS `std` otherwise."""

    name: str
    shape: tuple[int, ...]
    gguf_type: str
    std: float
    center: float = 0.0

    @property
    def nbytes(self) -> int:
        block, size = _block(self.gguf_type)
        assert self.gguf_type in SUPPORTED and self.shape[-1] % block == 0, (self.name, self.shape, self.gguf_type)
        return math.prod(self.shape[:-1]) * (self.shape[-1] // block) * size


def _block(gguf_type: str) -> tuple[int, int]:
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type]]


@functools.cache
def unit_rms(gguf_type: str) -> float:
    """The RMS of random blocks' values with the first scale field at 1 (MXFP4: exponent 2^0)."""
    import gguf

    _, size = _block(gguf_type)
    raw = np.random.default_rng(12345).integers(0, 256, size=(256, size), dtype=np.uint8)
    if gguf_type == "MXFP4":
        raw[:, 0] = 127
    for at, ratio in FP16_SCALES.get(gguf_type, ()):
        raw[:, at : at + 2] = np.full(256, ratio, np.float16).view(np.uint8).reshape(256, 2)
    values = gguf.quants.dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType[gguf_type]).astype(np.float64)
    return float(np.sqrt(np.mean(values**2)))


def random_rows(plan: TensorPlan, rows: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` rows of `plan`'s tensor as the bytes it stores."""
    k = plan.shape[-1]
    if plan.gguf_type == "F32":
        return (plan.center + plan.std * rng.standard_normal((rows, k))).astype(np.float32)
    block, size = _block(plan.gguf_type)
    n = rows * (k // block)
    raw = rng.integers(0, 1 << 64, size=-(-n * size // 8), dtype=np.uint64).view(np.uint8)[: n * size].reshape(n, size)
    unit = unit_rms(plan.gguf_type)
    if plan.gguf_type == "MXFP4":  # an E8M0 exponent byte, 2^(e-127): the powers of two either side of the
        x = math.log2(plan.std / unit)  # target, mixed so that the mean square is the target's
        up = (4 ** (x - math.floor(x)) - 1) / 3
        raw[:, 0] = 127 + math.floor(x) + (rng.random(n) < up)
    scale = plan.std / unit * rng.uniform(0.5, 1.5, size=n) / math.sqrt(13 / 12)  # mean square 1
    for at, ratio in FP16_SCALES.get(plan.gguf_type, ()):
        raw[:, at : at + 2] = (ratio * scale).astype(np.float16).view(np.uint8).reshape(n, 2)
    return raw


def add_tensor_infos(writer, plans: list[TensorPlan]) -> None:
    """The tensors' entries, before the writer writes its header."""
    import gguf

    for p in plans:
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes,
                               raw_dtype=gguf.GGMLQuantizationType[p.gguf_type])


def write_tensor_data(writer, plans: list[TensorPlan], seed: int) -> None:
    """The data section, after the writer's tensor infos: each tensor aligned as gguf-py's own
    write_tensor_data aligns it, generated and written a chunk of rows at a time."""
    fout, rng = writer.fout[0], np.random.default_rng(seed)
    for p in plans:
        writer.write_padding(fout, fout.tell())
        rows = math.prod(p.shape[:-1])
        step = max(1, CHUNK_BYTES // (p.nbytes // rows))
        for start in range(0, rows, step):
            fout.write(memoryview(random_rows(p, min(step, rows - start), rng)).cast("B"))
        writer.write_padding(fout, p.nbytes)
