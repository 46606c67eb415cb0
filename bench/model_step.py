"""Latency of one model step: decode at batch 1/8/32/64 sessions, and a 512-token prefill. Prints JSON.

    python bench/model_step.py [--model smollm2-135m-instruct] [--weights auto] [--kv-dtype auto] [--context 128] [--repeats 10]
                               [--enforce-eager]

The compiled package runs where the artifact has one (`python -m models.compiled_program ARTIFACT` makes it).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from kvcache import REGISTRY, CacheConfig, SessionCache
from models import DEFAULT_MODEL, load_model
from models.quant import ACTIVATIONS, WEIGHT_MODES
from server.config import KV_DTYPES
from server.engine.kv_pool import kv_dtype
from server.engine.model_thread import keep_step_buffers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weights", default="auto", choices=["auto", *WEIGHT_MODES])
    ap.add_argument("--activations", default=ACTIVATIONS[0], choices=ACTIVATIONS, help="as kvserve serve --activations")
    ap.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES, help="as kvserve serve --kv-dtype")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=128, help="history length of each decoding session")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--enforce-eager", action="store_true", help="program.py, not the compiled package")
    args = ap.parse_args()
    keep_step_buffers()  # as the engine does
    model = load_model(args.model, args.dtype, weights=args.weights, compiled=not args.enforce_eager,
                       activations=args.activations)
    c = model.config
    kv = kv_dtype(args.kv_dtype, model)
    layout = dict(n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, dtype=kv)
    vocab = c.vocab_size
    results = {"model": args.model, "dtype": args.dtype, "weights": model.weights, "activations": model.activations, "kv_dtype": str(kv).removeprefix("torch."), "threads": torch.get_num_threads(), "compiled": model.forward.compiled,
               "machine": platform.processor() or platform.machine(), "decode": {}}

    def forward(tokens, positions, rows):
        with torch.inference_mode():
            return model.forward(torch.tensor([tokens]), torch.tensor(positions).unsqueeze(1), torch.tensor(rows),
                                 torch.zeros(0, dtype=torch.long))[0]  # no hidden rows: a step without embeddings

    for b in [int(x) for x in args.batches.split(",")]:
        keys = [f"bench-{b}-{i}" for i in range(b)]
        for k in keys:
            REGISTRY.install(k, SessionCache(CacheConfig(capacity=args.context + args.repeats + 8, **layout)))
            with REGISTRY.active(k):
                forward(torch.randint(0, vocab, (args.context,)).tolist(), list(range(args.context)), [args.context - 1])
        step = REGISTRY.set_active([(k, 1) for k in keys])
        times = []
        for r in range(args.repeats + 1):
            pos = [args.context + r] * b
            t = time.perf_counter()
            forward(torch.randint(0, vocab, (b,)).tolist(), pos, list(range(b)))
            step.commit()  # a step as the runner runs it: the forward, then the commit
            times.append(time.perf_counter() - t)
        times = times[1:]  # the first step warms up
        med = statistics.median(times)
        results["decode"][str(b)] = {"median_ms": round(med * 1e3, 2), "p90_ms": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e3, 2),
                                     "tokens_per_s": round(b / med, 1)}
        for k in keys:
            REGISTRY.uninstall(k)
    REGISTRY.install("bench-prefill", SessionCache(CacheConfig(capacity=args.prefill, **layout)))
    times = []
    for _ in range(3):
        REGISTRY.get("bench-prefill").reset()
        step = REGISTRY.set_active("bench-prefill")
        t = time.perf_counter()
        forward(torch.randint(0, vocab, (args.prefill,)).tolist(), list(range(args.prefill)), [args.prefill - 1])
        step.commit()
        times.append(time.perf_counter() - t)
    med = statistics.median(times)
    results["prefill"] = {"tokens": args.prefill, "median_ms": round(med * 1e3, 1), "tokens_per_s": round(args.prefill / med, 1)}
    results["batch64_fraction_of_sgemm_ceiling"] = _ceiling_fraction(c, results)
    print(json.dumps(results, indent=2))


def _ceiling_fraction(c, results) -> dict:
    """Useful FLOPs of a batch-64 decode step over what this machine's best fp32 GEMM does in that time."""
    if "64" not in results["decode"]:
        return {}
    n = 4096
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    t = time.perf_counter()
    for _ in range(3):
        a @ b
    peak = 3 * 2 * n**3 / (time.perf_counter() - t)
    # per token: 2 FLOPs per weight of every matmul (attention over a short history is negligible)
    per_layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim + 3 * c.dim * c.ffn_dim
    flops_per_token = 2 * (c.n_layers * per_layer + c.dim * c.vocab_size)
    achieved = flops_per_token * results["decode"]["64"]["tokens_per_s"]
    return {"sgemm_peak_gflops": round(peak / 1e9, 1), "step_gflops": round(achieved / 1e9, 1),
            "fraction": round(achieved / peak, 3), "mflop_per_token": round(flops_per_token / 1e6, 1)}


if __name__ == "__main__":
    main()
