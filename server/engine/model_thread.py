"""The one thread that runs torch's parallel work: load, warm up and step the model there.

libgomp gives every thread that starts a parallel region a team of its own. Once a second team
exists (say the event loop's, from loading the model), libgomp sees more threads than cores and
stops spinning between regions, and a decode step, made of many short parallel regions, takes several
times as long (docs/performance.md). So the model thread owns every core, and the event
loop thread keeps its own torch work (cache allocation, copies) on itself.
"""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor

import torch

# Read at import, before any thread calls keep_torch_serial (which sets its own count to 1).
TORCH_THREADS = torch.get_num_threads()

# glibc's mallopt parameters, and the sizes up to which freed blocks stay in the heap for reuse. By
# default glibc maps larger blocks afresh and trims the heap's free top, so each step's big tensors
# (logits, [32, 49152] sampling temporaries) came back as new pages, faulted in one at a time:
# temperature sampling of a full batch was far slower than with these limits (docs/performance.md).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEEP_BLOCKS_BELOW = 32 << 20
KEEP_FREE_TOP = 64 << 20


def model_thread(threads: int | None = None) -> ThreadPoolExecutor:
    """A one-thread executor whose thread runs torch with `threads` threads (default: torch's own count)."""
    threads = threads or TORCH_THREADS
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-model", initializer=torch.set_num_threads,
                              initargs=(threads,))


def keep_step_buffers() -> bool:
    """Let glibc reuse freed blocks under 32 MB instead of unmapping them -> whether it applied (not glibc: no)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, KEEP_BLOCKS_BELOW)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_FREE_TOP))


def keep_torch_serial() -> None:
    """Make torch calls from this thread run on it alone, so they never start a thread team.

    Reading the count first makes torch settle this thread's OpenMP setting now (it does so lazily, on
    a thread's first query, from the process-wide count, which the model thread sets), so the
    set_num_threads(1) after it stays this thread's own.
    """
    torch.get_num_threads()
    torch.set_num_threads(1)
