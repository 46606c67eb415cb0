"""Where a model's weights live: in memory the kernel backs with 2 MiB pages where it can.

A decode step at one stream reads every weight once, and with 4 KiB pages that is a TLB miss every 4 KiB
of a stream the hardware prefetcher also stops at. Transparent huge pages are often granted only on
request (`madvise` mode), so each large weight buffer asks for them, before its first touch; where the
kernel says no, the buffer is an ordinary one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


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
    """A safetensors file's tensors, each read straight into its own empty_weight buffer: the file is never
    mapped, so a load holds the weights once. Without `values`, the buffers of more than `small` bytes are
    left unread and untouched: shapes for a compiler (compiled_program.py), which reads at most the values
    of a few small tensors."""
    with open(path, "rb", buffering=0) as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        base = 8 + header_len
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            out = empty_weight(tuple(info["shape"]), SAFETENSORS_DTYPES[info["dtype"]])
            view = out.view(-1).view(torch.uint8).numpy() if out.numel() and (values or end - begin <= small) else None
            if view is not None and os.preadv(f.fileno(), [view], base + begin) != end - begin:
                raise OSError(f"{path}: tensor {name} ends past the end of the file")
            tensors[name] = out
    return tensors
