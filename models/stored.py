"""A weight as its file stores it: where its bytes are, its type and shape. Nothing is read until a
module is built from it, and then a chunk of rows at a time, so a load never holds the file twice."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .errors import ModelLoadError
from .file_reads import read_buffer, read_into
from .formats import FLOAT_TYPES, FORMATS, CorruptBlock


class UnsupportedTensorType(ModelLoadError):
    """A tensor's type has no kernel here; requantizing it (--weights q4_0, q8_0, ...) would serve it."""


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's interleaved-rope permutation of a q/k weight [n_heads * D, dim] (or bias)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)  # [H, 2, D/2, ...] -> [H*D, ...]


@dataclass(frozen=True)
class StoredTensor:
    """A GGUF tensor [N, K] (or [K]) of `type`, at `offset` in `path`. `heads` > 0: its rows are read in
    llama.cpp's interleaved-rope order and handed out un-permuted, head by head."""

    name: str
    path: Path
    offset: int
    type: str
    shape: tuple[int, ...]
    heads: int = 0

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_bytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[self.type]]
        return self.shape[-1] // block * size

    @property
    def is_float(self) -> bool:
        return self.type in FLOAT_TYPES

    def check_type(self) -> None:
        if self.type not in FLOAT_TYPES and self.type not in FORMATS:
            raise UnsupportedTensorType(
                f"tensor {self.name} is {self.type}, which kvserve has no kernel for (it serves "
                f"{', '.join([*FORMATS, *FLOAT_TYPES])}); pass --weights q4_0, q8_0 or f16 to requantize it")

    def _pread(self, r0: int, r1: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows r0..r1's bytes, read into `into` (file_reads.read_buffer's: direct) if given, else a new tensor."""
        n = (r1 - r0) * self.row_bytes
        buffer = torch.empty(n, dtype=torch.uint8) if into is None else into
        raw = read_into(self.path, self.offset + r0 * self.row_bytes, n, buffer)
        if raw is None:
            raise ModelLoadError(f"{self.path}: truncated (tensor {self.name} ends past the end of the file)")
        return raw.view(r1 - r0, self.row_bytes)

    def read_rows(self, r0: int, r1: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Rows r0..r1 as stored bytes [r1 - r0, row bytes] uint8, un-permuted if `heads`; read into `into`
        (a read_buffer of at least their bytes) if given, unless un-permuted."""
        if not self.heads:
            return self._pread(r0, r1, into)
        d = self.rows // self.heads  # rows a head
        h0, h1 = r0 // d, -(-r1 // d)
        raw = unpermute_qk(self._pread(h0 * d, h1 * d), h1 - h0)  # a row's bytes move with it
        return raw[r0 - h0 * d : r1 - h0 * d]

    def floats(self) -> torch.Tensor:
        """A float tensor, in its stored dtype and our shape."""
        assert self.is_float, "only float tensors read as floats"
        raw = self.read_rows(0, self.rows) if len(self.shape) == 2 else self._pread(0, 1)
        return raw.reshape(-1).view(FLOAT_TYPES[self.type]).reshape(self.shape)

    def dequantize(self) -> torch.Tensor:
        """The tensor as float32 (a block type's own decoding, or gguf's for types without a kernel)."""
        if self.is_float:
            return self.floats().float()
        if self.type in FORMATS:
            with self._reading():
                return FORMATS[self.type].dequantize(self.read_rows(0, self.rows))
        import gguf

        raw = self.read_rows(0, self.rows).numpy()
        try:
            values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[self.type])
        except NotImplementedError:
            raise UnsupportedTensorType(f"tensor {self.name} has type {self.type}, which cannot be read here") from None
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(self.shape)

    def panels(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor repacked as its format's panels, chunk by chunk (into `out` if given), the chunks read
        into two buffers in turn: one is repacked while the next chunk is read into the other."""
        fmt = FORMATS[self.type]
        step = fmt.chunk_rows(self.row_bytes)
        buffers = [read_buffer(min(step, self.rows) * self.row_bytes) for _ in range(2 if step < self.rows else 1)]
        with self._reading():
            return fmt.panels(lambda r0, r1: self.read_rows(r0, r1, buffers[r0 // step % len(buffers)]), self.rows, out, step)

    @contextlib.contextmanager
    def _reading(self):
        try:
            yield
        except CorruptBlock as e:
            raise ModelLoadError(f"{self.path}: tensor {self.name} is damaged: {e}") from None
