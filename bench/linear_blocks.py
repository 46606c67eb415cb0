"""One projection's product on each block format, by rows: the kernel alone, at the read bandwidth or at
the multiply-adds. Prints JSON.

    python bench/linear_blocks.py [--formats Q4_K,Q6_K,Q4_0,Q8_0] [--rows 1,4,8,32] [--copies 12]
                                  [--activations int16,int8] [--shape N,K]

Each format holds a 1B model's FFN weight of random blocks (8192 x 2048; Q6_K as the down projection,
2048 x 8192), `--copies` of it, so that a pass over them all reads from memory rather than the cache
(`--copies 1 --shape 1024,1024 --threads 1`: from one core's L2, what the arithmetic alone allows). A
figure is the best of 20 passes: microseconds a product, and the weight bytes it read a second.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.formats import FORMATS  # noqa: E402
from models.formats.panels import INT8_ACTIVATIONS  # noqa: E402
from models.quant import ACTIVATIONS, model_kernels_available  # noqa: E402
from tests.models.gguf_files import random_blocks  # noqa: E402

SHAPES = {"Q6_K": (2048, 8192)}  # rows x k; the others: (8192, 2048)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="Q4_K,Q6_K,Q4_0,Q8_0")
    ap.add_argument("--rows", default="1,4,8,32")
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", default=ACTIVATIONS[0], help="int8, int16 or both (comma-separated), in turns")
    ap.add_argument("--shape", default=None, help="rows,k of every format's weight instead of a 1B model's")
    args = ap.parse_args()
    if not model_kernels_available():
        raise SystemExit("the kernels are unavailable here (kvserve kernels builds them)")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    out = {}
    for name in args.formats.split(","):
        n, k = tuple(int(v) for v in args.shape.split(",")) if args.shape else SHAPES.get(name, (8192, 2048))
        raw = torch.from_numpy(random_blocks(name, n, k, rng).copy()).reshape(n, -1)
        fmt = FORMATS[name]
        weights = [fmt.panels(lambda r0, r1: raw[r0:r1], n) for _ in range(args.copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            for acts in args.activations.split(","):
                kind = fmt.kind.id | (INT8_ACTIVATIONS if acts == "int8" else 0)
                for w in weights:
                    torch.ops.kvserve_native.linear_blocks(x, [w], [n], [kind])
                best = float("inf")
                for _ in range(20):
                    start = time.perf_counter()
                    for w in weights:
                        torch.ops.kvserve_native.linear_blocks(x, [w], [n], [kind])
                    best = min(best, (time.perf_counter() - start) / len(weights))
                key = f"{name} x{m} {acts}"
                out[key] = {"us": round(best * 1e6, 1), "read_gb_s": round(weights[0].numel() / best / 1e9, 1)}
    print(json.dumps({"threads": args.threads, "copies": args.copies, "products": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
