"""Where a model's weights live: in memory the kernel backs with 2 MiB pages where it can.

A decode step at one stream reads every weight once, and with 4 KiB pages that is a TLB miss every 4 KiB
of a stream the hardware prefetcher also stops at. Transparent huge pages are often granted only on
request (`madvise` mode), so each large weight buffer asks for them, before its first touch; where the
kernel says no, the buffer is an ordinary one. A saved artifact's weights are its file, mapped (map_file).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import mmap
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
MADV_POPULATE_READ = 22  # linux/mman.h, Linux 5.14


@functools.cache
def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.madvise
    except (OSError, AttributeError):
        return None


def empty_weight(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised weight buffer: from HUGE_PAGE bytes on, a 2 MiB-aligned view of one a page
    larger, its pages asked to be huge."""
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * dtype.itemsize
    madvise = _madvise()
    if nbytes < HUGE_PAGE or madvise is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    buf = raw[start : start + nbytes]
    madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)  # a refusal leaves 4 KiB pages
    return buf.view(dtype).view(shape)


# safetensors' dtype names -> torch's
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


def read_safetensors(path: Path, values: bool = True, small: int = 0) -> dict[str, torch.Tensor]:
    """A safetensors file's tensors. With `values`, views of one private mapping of the file (map_file);
    without, empty_weight buffers left unread but for those of at most `small` bytes: shapes for a
    compiler (compiled_program.py), which reads at most the values of a few small tensors."""
    with open(path, "rb", buffering=0) as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        base, size = 8 + header_len, os.fstat(f.fileno()).st_size
        mapped = map_file(f) if values else None
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            shape, dtype = tuple(info["shape"]), SAFETENSORS_DTYPES[info["dtype"]]
            if base + end > size:
                raise OSError(f"{path}: tensor {name} ends past the end of the file")
            if mapped is not None and end > begin and (base + begin) % dtype.itemsize == 0:
                tensors[name] = torch.frombuffer(mapped, dtype=torch.uint8, count=end - begin, offset=base + begin
                                                 ).view(dtype).view(shape)
                continue
            out = empty_weight(shape, dtype)
            if out.numel() and (values or end - begin <= small):
                os.preadv(f.fileno(), [out.view(-1).view(torch.uint8).numpy()], base + begin)
            tensors[name] = out
    return tensors


def map_file(f) -> mmap.mmap:
    """The whole of open file f, mapped privately, asked for 2 MiB pages and read in.

    Why a mapping: a start from a cached artifact then takes the weights from the page cache where they
    already are, instead of copying them into memory nothing has touched, which a VM backs page by page
    as it is first written (docs/performance.md). Where the filesystem holds the file in 2 MiB folios
    (ext4 on Linux 6.x), MADV_HUGEPAGE maps them whole, so a step's stream of weights sees no more TLB
    misses than in huge anonymous pages. Private: a write to a weight, which nothing makes, would copy
    its page, never change the file. Read in up front (MADV_POPULATE_READ), so a start from disk reports
    healthy only once its first step will not wait on the disk."""
    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    for advice in (mmap.MADV_HUGEPAGE, MADV_POPULATE_READ):
        with contextlib.suppress(OSError):  # an older kernel: 4 KiB pages, read in by the first step
            mapped.madvise(advice)
    return mapped
