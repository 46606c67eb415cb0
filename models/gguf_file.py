"""A GGUF file's header: its metadata and where each tensor's bytes lie, read in one pass over the header.

gguf-py's GGUFReader builds a numpy view for every part of every field, which for a 151,936-token
vocabulary and its merges is most of a minute of a large file's load; this reads the same values,
string arrays as one loop and number arrays as one numpy view each. Little-endian files, versions 2 and 3.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelLoadError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type id -> (struct code, numpy dtype) of GGUF's fixed-size scalars
SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
           5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64), 11: ("<q", np.int64),
           12: ("<d", np.float64)}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its name, shape as GGUF lists it (the row length first), type and bytes in the file."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    data_offset: int
    n_bytes: int


class _Cursor:
    def __init__(self, data) -> None:
        self.data, self.at = data, 0

    def scalar(self, code: str):
        value = struct.unpack_from(code, self.data, self.at)[0]
        self.at += struct.calcsize(code)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.data[self.at : self.at + n])
        if len(raw) != n:
            raise ValueError("a string runs past the end of the file")
        self.at += n
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == STRING:
            return self.string()
        if kind == ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item == STRING:
                return [self.string() for _ in range(count)]
            if item in SCALARS:
                dtype = np.dtype(SCALARS[item][1]).newbyteorder("<")
                values = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.at)
                self.at += values.nbytes
                return values.tolist()
            return [self.value(item) for _ in range(count)]  # arrays of arrays
        if kind not in SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.scalar(SCALARS[kind][0])


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """-> (metadata {key: value}, the tensors in file order). Raises ModelLoadError on a file that is not a
    GGUF, is damaged or truncated, or holds a tensor type this gguf-py does not know."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            c = _Cursor(data)
            if bytes(data[:4]) != MAGIC:
                raise ValueError("no GGUF magic")
            c.at = 4
            version = c.scalar("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (big-endian or unknown) is not supported")
            n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
            meta = {}
            for _ in range(n_kv):
                key = c.string()
                meta[key] = c.value(c.scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = c.string()
                shape = tuple(c.scalar("<Q") for _ in range(c.scalar("<I")))
                infos.append((name, shape, c.scalar("<I"), c.scalar("<Q")))
            alignment = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
            base = -(-c.at // alignment) * alignment
    except (OSError, ValueError, struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ModelLoadError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
    tensors = []
    for name, shape, type_id, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ModelLoadError(f"{path}: tensor {name} has an unknown type {type_id}") from None
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        tensors.append(TensorInfo(name, shape, qtype.name, base + offset, count // block * size))
    return meta, tensors
