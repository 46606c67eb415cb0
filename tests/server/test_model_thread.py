"""Torch's parallel threads stay with the model thread; the event loop's torch calls run serially."""
import threading

import pytest
import torch

from server.engine.model_thread import TORCH_THREADS, keep_torch_serial, model_thread


def test_the_model_thread_keeps_every_core_and_the_loop_thread_none():
    worker = model_thread()
    seen = {}

    def event_loop_thread():
        keep_torch_serial()
        torch.ones(1_000_000).add_(1)  # large enough for a parallel region, had the thread any threads
        seen["loop"] = torch.get_num_threads()

    try:
        # the loop thread settles after the worker exists and before it runs: either order must hold
        loop = threading.Thread(target=event_loop_thread)
        loop.start()
        loop.join()
        seen["model"] = worker.submit(torch.get_num_threads).result()
        seen["model after a parallel op"] = worker.submit(lambda: (torch.ones(1_000_000).add_(1), torch.get_num_threads())[1]).result()
    finally:
        worker.shutdown()
    assert seen == {"loop": 1, "model": TORCH_THREADS, "model after a parallel op": TORCH_THREADS}


# A fresh process, so that no other thread's faults and no earlier test's heap count. Its main thread
# allocates, writes and frees a step-sized buffer that grows by 64 KB a step, as a step's logits and
# activations vary with its tokens: with glibc's defaults each one is a new mapping, faulted in anew.
FAULTS = """
import resource, sys, torch
from server.engine.model_thread import keep_step_buffers
if sys.argv[1] == "keep":
    assert keep_step_buffers()
torch.set_num_threads(1)  # every page is touched on this thread, which RUSAGE_THREAD counts
def step(i):
    torch.ones((16 << 18) + i * (16 << 10)).add_(1)
for i in range(8):  # kept, the heap grows to fit over the first few
    step(i)
before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
for i in range(8, 18):
    step(i)
print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
"""


def test_step_sized_buffers_are_reused_not_faulted_in_afresh():
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")

    def faults(mode: str) -> int:
        done = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    pages = (16 << 20) // 4096  # one 16 MB buffer's pages
    default, kept = faults("default"), faults("keep")
    assert default > 5 * pages, f"{default} page faults with glibc's defaults: the workload no longer shows the difference"
    assert kept < 1000, f"{kept} page faults for 10 steps of 16 MB: the pages were not reused (defaults: {default})"
