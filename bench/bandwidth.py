"""The machine's memory read bandwidth, as torch reads it: the bound a decode step that reads every
weight once per token can reach, so that "fraction of the limit" is a ratio measured in the same run.

    python bench/bandwidth.py [--mib 256] [--threads 1,2] [--repeats 20]

Sums a --mib MiB float32 tensor (far larger than the caches) --repeats times on each thread count and
keeps the best run. Prints JSON: GB/s per thread count.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def read_gb_s(mib: int, threads: int, repeats: int) -> float:
    torch.set_num_threads(threads)
    x = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    x.sum()  # pages touched, threads woken
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def measure(mib: int = 256, threads: tuple[int, ...] = (1, 2), repeats: int = 20) -> dict[str, float]:
    before = torch.get_num_threads()
    try:
        return {str(t): round(read_gb_s(mib, t, repeats), 2) for t in threads}
    finally:
        torch.set_num_threads(before)


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
