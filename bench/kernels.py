"""One q4 linear and one step of long-history attention, timed alone (best of many calls). Prints JSON.

    python bench/kernels.py [--threads 2] [--sessions 32] [--history 2000]

To compare two checkouts, run it from each in turns (`PYTHONPATH=<checkout>`): the kernels are built
from the checkout's sources.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from kvcache import REGISTRY, CacheConfig, SessionCache
from models.quant import LinearBlocks, load_model_kernels

# SmolLM2-135M's shapes: (name, out features, in features, rows)
LINEARS = [("gate_up", 3072, 576, 512), ("gate_up", 3072, 576, 32), ("down", 576, 1536, 32), ("gate_up", 3072, 576, 1),
           ("lm_head", 49152, 576, 1)]
LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 3, 9, 64


def best_of(fn, calls: int) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def linears() -> dict:
    out = {}
    for name, n, k, rows in LINEARS:
        fast = LinearBlocks.quantized(torch.nn.Linear(k, n, bias=False), "q8" if name == "lm_head" else "q4")
        x = torch.randn(rows, k)
        with torch.no_grad():
            out[f"{name} {n}x{k}, {rows} rows, us"] = round(best_of(lambda: fast(x), max(10, 3000 // rows)) * 1e6, 1)
    return out


def attention(sessions: int, history: int) -> float:
    """One decode step's attention, every layer, over `sessions` float16 histories -> seconds."""
    keys = [f"bench-{i}" for i in range(sessions)]
    layout = dict(n_layers=LAYERS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float16)
    attend = torch.ops.kvcache.update_and_attend
    for key in keys:  # histories written straight in: attending over them as a prefill would take minutes
        cache = SessionCache(CacheConfig(capacity=history + 8, **layout), key=key)
        cache.reserve(history)
        for layer in range(LAYERS):
            cache.write(layer, torch.randn(KV_HEADS, history, HEAD_DIM), torch.randn(KV_HEADS, history, HEAD_DIM))
        cache.commit(history)
        REGISTRY.install(key, cache)
    q, kv = torch.randn(1, Q_HEADS, sessions, HEAD_DIM), torch.randn(1, KV_HEADS, sessions, HEAD_DIM)
    positions = torch.full((sessions, 1), history)

    def step() -> None:
        active = REGISTRY.set_active([(key, 1) for key in keys])
        try:
            with torch.inference_mode():
                for layer in range(LAYERS):
                    attend(q, kv, kv, positions, layer, HEAD_DIM**-0.5, torch.float32)
        finally:
            active.abort()  # the histories stay as they were, for the next call
            REGISTRY.set_active(None)

    try:
        return best_of(step, 8)
    finally:
        for key in keys:
            REGISTRY.uninstall(key)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--history", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_model_kernels()
    REGISTRY.native_attention()
    print(json.dumps({"threads": args.threads, "linear": linears(),
                      f"attention, {args.sessions} x {args.history} tokens, 30 layers, ms":
                          round(attention(args.sessions, args.history) * 1e3, 1)}, indent=2))


if __name__ == "__main__":
    main()
