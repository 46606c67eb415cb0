"""The machine's memory read bandwidth, as torch reads it: the bound a decode step that reads every
weight once per token can reach, so that "fraction of the limit" is a ratio measured in the same run.

    python bench/bandwidth.py [--mib 256] [--threads 1,2] [--repeats 20]

Sums a --mib MiB float32 tensor (far larger than the caches) --repeats times on each thread count and
keeps the best run. Prints JSON: GB/s per thread count. bench/compare_llamacpp.py takes instead the
median over a tensor the size of the model file, just before the one-stream load (`typical`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def rates(nbytes: int, threads: int, repeats: int) -> list[float]:
    """GB/s of each of `repeats` sums of an `nbytes` float32 tensor on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        x.sum()  # pages touched, threads woken
        out = []
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            out.append(x.numel() * 4 / (time.perf_counter() - start) / 1e9)
        return out
    finally:
        torch.set_num_threads(before)


def measure(mib: int = 256, threads: tuple[int, ...] = (1, 2), repeats: int = 20) -> dict[str, float]:
    """The best of the sums' rates, per thread count: what the bus gives at its best."""
    return {str(t): round(max(rates(mib * 2**20, t, repeats)), 2) for t in threads}


def typical(nbytes: int, threads: int, repeats: int = 10) -> float:
    """The median of the sums' rates over `nbytes`, read as a decode step reads a model of that size: the
    bus a stream measured by its median inter-token latency has, in the same minute."""
    return round(statistics.median(rates(nbytes, threads, repeats)), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    threads = tuple(int(t) for t in args.threads.split(","))
    print(json.dumps({"mib": args.mib, "read_gb_s": measure(args.mib, threads, args.repeats)}, indent=2))


if __name__ == "__main__":
    main()
