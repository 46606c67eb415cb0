"""One mixture-of-experts layer's expert op at a real model's shape, timed alone: the native op
(kernels/moe_experts.cpp) against models/moe.py's per-expert path on the same weights. Prints JSON.

    python bench/moe_layer.py [--model qwen3-30b-a3b|gpt-oss-20b] [--rows 1,8,32] [--calls 20] [--threads 2]

The weights are random blocks in the file's formats (Q4_K gate/up and Q6_K down for Qwen3-30B-A3B's
Q4_K_M, MXFP4 with biases for gpt-oss-20b), held as panels as a load holds them; the router's logits are
random, so a batch's rows spread over the experts as real ones roughly do. Each figure is the median
of --calls calls, after three unmeasured; the bytes a call reads (its distinct experts' weights) over
that time is the rate it streams them at.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.moe_files import SPECS  # noqa: E402
from bench.random_blocks import TensorPlan, random_rows  # noqa: E402
from models import moe  # noqa: E402
from models.formats import FORMATS  # noqa: E402
from models.formats.panels import INT8_ACTIVATIONS  # noqa: E402
from models.moe_config import ROUTINGS  # noqa: E402
from models.quant import load_model_kernels  # noqa: E402

# model -> the types of gate, up and down as its file holds them, the routing, and its clamped SwiGLU
LAYERS = {"qwen3-30b-a3b": (("Q4_K", "Q4_K", "Q6_K"), "softmax_norm", (0.0, 0.0)),
          "gpt-oss-20b": (("MXFP4", "MXFP4", "MXFP4"), "topk_softmax", (7.0, 1.702))}


def expert_weight(gguf_type: str, experts: int, rows: int, k: int, rng) -> tuple[torch.Tensor, int]:
    """[E, rows, k] random blocks -> each expert's panels [E, P, units, bytes] and the bytes an expert holds."""
    plan = TensorPlan("w", (rows, k), gguf_type, 1 / np.sqrt(k))
    fmt = FORMATS[gguf_type]
    panels, nbytes = [], 0
    for _ in range(experts):
        raw = torch.from_numpy(random_rows(plan, rows, rng).reshape(rows, -1))
        nbytes = raw.numel()
        panels.append(fmt.panels(lambda r0, r1: raw[r0:r1], rows))
    return torch.stack(panels), nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(LAYERS))
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_model_kernels()
    spec = SPECS[args.model]
    types, routing, (limit, alpha) = LAYERS[args.model]
    E, C, F, k = spec.experts, spec.hidden, spec.expert_ffn, spec.experts_used
    rng = np.random.default_rng(0)
    parts = [expert_weight(types[0], E, F, C, rng), expert_weight(types[1], E, F, C, rng), expert_weight(types[2], E, C, F, rng)]
    weights, expert_bytes = [p for p, _ in parts], sum(b for _, b in parts)
    kinds = [FORMATS[t].kind.id | INT8_ACTIVATIONS for t in types]
    biases = [torch.randn(E, n) * 0.02 for n in (F, F, C)] if limit else [None, None, None]
    out = {"model": args.model, "types": types, "threads": args.threads, "rows": {}}
    for n in (int(r) for r in args.rows.split(",")):
        g = torch.Generator().manual_seed(n)
        x, logits = torch.randn(n, C, generator=g), torch.randn(n, E, generator=g)
        ids, route_weights = moe.route(logits, k, ROUTINGS[routing])
        distinct = ids.unique().numel()
        calls = {"native": lambda: torch.ops.kvserve_native.moe_blocks(x, ids, route_weights, weights, [F, F, C], kinds,
                                                                        *biases, limit, alpha),
                 "per_expert": lambda: moe._grouped(x, ids, route_weights, weights, [F, F, C], kinds, *biases, limit, alpha)}
        row = {"experts_read": distinct}
        for name, fn in calls.items():
            for _ in range(3):
                fn()
            times = []
            for _ in range(args.calls):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            ms = statistics.median(times) * 1e3
            row[name] = {"ms": round(ms, 3), "read_gb_s": round(distinct * expert_bytes / ms / 1e6, 2)}
        out["rows"][n] = row
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
