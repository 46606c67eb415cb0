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


def test_step_sized_buffers_are_reused_not_faulted_in_afresh():
    import platform
    import resource

    from server.engine.model_thread import keep_step_buffers

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("mallopt is glibc's")
    assert keep_step_buffers()

    def cycle():
        torch.ones(16 << 18).add_(1)  # 16 MB, written and freed, as a step's logits are

    for _ in range(6):  # the heap grows to fit over the first few (4 here)
        cycle()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        cycle()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    # glibc's defaults fault every page in anew: ~2000 per cycle here (4 KB pages, some huge)
    assert faults < 1000, f"{faults} page faults for 10 cycles of 16 MB: the pages were not reused"
