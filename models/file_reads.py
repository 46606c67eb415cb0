"""A weight file's bytes read for the load: straight from the disk into a buffer (O_DIRECT) where the file
system allows it, else through the page cache.

Why direct: a load reads each byte once, and a cold buffered read of a file the size of the memory runs at
a third of the disk's rate, and fills the memory with pages the weights then have to evict, piece by
piece, to get their huge pages (weight_memory.py). Read direct, the file leaves the memory free.
"""
from __future__ import annotations

import mmap
import os

import torch

ALIGN = 4096  # what O_DIRECT asks of an offset, a length and an address (a page: every block size below it)


def read_buffer(n: int) -> torch.Tensor:
    """A buffer for reads of up to n bytes: page-aligned, with room for the alignment, in a mapping of its
    own that is unmapped with the last view of it (the allocator's heap would keep it)."""
    return torch.frombuffer(mmap.mmap(-1, n + 2 * ALIGN), dtype=torch.uint8)


def _read_fully(fd: int, view, offset: int) -> int:
    done = 0
    while done < len(view):  # one read returns at most about 2 GiB
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


def read_into(path, offset: int, n: int, buffer: torch.Tensor) -> torch.Tensor | None:
    """n bytes at `offset` of the file, read into `buffer` -> a view of them [n], or None if the file ends
    first. Direct where the buffer is read_buffer's (page-aligned, with room for the aligned span)."""
    start = offset - offset % ALIGN
    end = -(-(offset + n) // ALIGN) * ALIGN
    view = buffer.numpy()
    got = -1
    if buffer.data_ptr() % ALIGN == 0 and end - start <= buffer.numel() and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                got = _read_fully(fd, view[: end - start], start) - (offset - start)
            finally:
                os.close(fd)
        except OSError:  # a file system without O_DIRECT (tmpfs, some network ones), or a short read at its end
            got = -1
    if got < 0:
        start = offset
        with open(path, "rb", buffering=0) as f:
            got = _read_fully(f.fileno(), view[:n], offset)
    if got < n:
        return None
    return buffer[offset - start : offset - start + n]
