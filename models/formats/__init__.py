"""GGUF's block formats, each served as stored: a block type with its traits, its decoding, and the
panel kind it is repacked into for the CPU (panels.py), losslessly. One file a format; this is the table."""
from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from .panels import KINDS, PANEL, PANEL_GROUP, PanelKind, pack, panel_count

# rows repacked at a time in Python: bounds the load's transient memory to a few MB a tensor
CHUNK_ROWS = 1024
# bytes of rows repacked at a time natively: few calls and reads, and transient memory still bounded
NATIVE_CHUNK_BYTES = 32 << 20
# the float types a file may store a weight in, served by the float kernels as they are
FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class CorruptBlock(ValueError):
    """A block's scale is not a finite number: the file is damaged."""


DAMAGED = "a block holds a scale that is not a finite number"


@functools.cache
def native_repack() -> bool:
    """Whether the kernels (kernels/repack.cpp among them) load here; else the repack runs in Python."""
    from ..quant import model_kernels_available

    return model_kernels_available()


def halves(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte `at` of each block: raw [R, nb, bytes] -> [R, nb] float16, all finite."""
    values = raw[..., at : at + 2].contiguous().view(torch.float16).squeeze(-1)
    # an fp16 is infinite or NaN when its exponent bits are all ones
    if bool(((values.view(torch.int16) & 0x7C00) == 0x7C00).any()):
        raise CorruptBlock(DAMAGED)
    return values


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of a 32-weight block [..., 16] -> its weights [..., 32]: low nibbles first, as ggml packs them."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def bits(packed: torch.Tensor) -> torch.Tensor:
    """Little-endian bit fields [..., n] uint8 -> [..., 8n] of 0/1, bit i of the whole at i."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


Decoded = tuple[torch.Tensor, list[torch.Tensor]]


@dataclass(frozen=True)
class BlockFormat:
    """One GGUF block type: `block` weights in `bytes` bytes, decoded into a panel kind's quants and fields."""

    name: str
    block: int
    bytes: int
    kind_name: str
    decode: Callable[[torch.Tensor], Decoded]  # raw [R, nb, bytes] -> quants [R, nb', qk], fields (PanelKind.pack's)

    @property
    def kind(self) -> PanelKind:
        return KINDS[self.kind_name]

    def row_bytes(self, k: int) -> int:
        return k // self.block * self.bytes

    def _decoded(self, raw: torch.Tensor) -> Decoded:
        return self.decode(raw.reshape(raw.shape[0], -1, self.bytes))

    def units(self, row_bytes: int) -> int:
        """A row's panel units."""
        return row_bytes // self.bytes * self.block // self.kind.unit

    def chunk_rows(self, row_bytes: int) -> int:
        """Rows repacked at a time, whole panel groups: about NATIVE_CHUNK_BYTES natively, else CHUNK_ROWS."""
        if not native_repack():
            return CHUNK_ROWS
        group = PANEL * PANEL_GROUP
        return max(group, NATIVE_CHUNK_BYTES // row_bytes // group * group)

    def panels(self, read_rows: Callable[[int, int], torch.Tensor], n: int, out: torch.Tensor | None = None,
               chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
        """The n-row weight whose raw rows read_rows(r0, r1) gives -> panels, chunk_rows (whole panel
        groups) at a time (into `out` if given): natively where the kernels are, else in Python.

        A thread reads each chunk while the one before it is repacked, so that a load from a cold disk
        waits on the disk or the repack, not their sum: read_rows is called in order, one chunk ahead."""
        assert chunk_rows % (PANEL * PANEL_GROUP) == 0, "chunks fill whole panel groups"
        repack = self.repack if native_repack() else self.repack_python
        with ThreadPoolExecutor(1, thread_name_prefix="kvserve-read") as reader:
            ahead = reader.submit(read_rows, 0, min(n, chunk_rows))
            for r0 in range(0, n, chunk_rows):
                r1 = min(n, r0 + chunk_rows)
                raw = ahead.result()
                if r1 < n:
                    ahead = reader.submit(read_rows, r1, min(n, r1 + chunk_rows))
                if out is None:
                    out = torch.empty(panel_count(n), self.units(raw.shape[1]), self.kind.bytes, dtype=torch.uint8)
                repack(raw, out[r0 // 8 : r0 // 8 + panel_count(r1 - r0)])
        return out

    def repack(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """Raw rows [R, row bytes] -> their panels, into `out` [panel_count(R), units, bytes] (kernels/repack.cpp)."""
        if torch.ops.kvserve_native.repack_blocks(raw, self.name, out):
            raise CorruptBlock(DAMAGED)

    def repack_python(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """repack's reference: decode, then pack."""
        q, fields = self._decoded(raw)
        pack(q, fields, self.kind, out)

    def dequantize(self, raw: torch.Tensor) -> torch.Tensor:
        """raw rows [R, row bytes] -> the weight [R, K] float32."""
        return self.kind.dequantize(*self._decoded(raw))


def _table() -> dict[str, BlockFormat]:
    from . import mxfp4, q4_0, q4_1, q4_k, q5_0, q5_1, q5_k, q6_k, q8_0

    return {m.FORMAT.name: m.FORMAT for m in (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, mxfp4)}


FORMATS = _table()
