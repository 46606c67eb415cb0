"""Torch's parallel threads stay with the model thread; the event loop's torch calls run serially."""
import threading

import torch

from server.model_thread import TORCH_THREADS, keep_torch_serial, model_thread


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
