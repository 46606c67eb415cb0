"""Greedy agreement with llama-server on the same GGUF file: how many of the first tokens both servers pick
alike. Prints JSON.

    python bench/greedy_agreement.py [--files Q4_1,Q4_0,Q4_K_M,Q8_0] [--prompts 16] [--tokens 64]
                                     [--activations int8]

For each file (named as bench/compare_llamacpp.py's --file names them), both servers answer the same
prompts greedily, and give the token ids: kvserve's TGI `/generate` with `details`, llama-server's
`/completion` with `return_tokens`. A prompt's figure is the length of the two replies' common prefix;
a file's, its mean and median, and the share of prompts whose replies are the same throughout; each
server is also set beside kvserve's `--weights f32` on the same file (the file's weights dequantized,
float32 throughout), which shows which of the two strays from the exact product. Float
rounding differs between any two kernels (both round activations to int8 by their own blocks; kvserve's
--activations int16 sums products all but exactly), so replies part where two candidates' logits were
nearly tied, and each follows its own text after that.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare_llamacpp import compared_file, distinct_text  # noqa: E402
from launch import launched_server  # noqa: E402
from llama_server import build, llama_server  # noqa: E402

from models.quant import ACTIVATIONS  # noqa: E402


def kvserve_ids(url: str, prompt: str, tokens: int) -> list[int]:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": tokens, "details": True, "do_sample": False}}
    r = httpx.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return [t["id"] for t in r.json()["details"]["tokens"]]


def llama_ids(url: str, prompt: str, tokens: int) -> list[int]:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "top_k": 1, "return_tokens": True,
            "cache_prompt": False}
    r = httpx.post(url + "/completion", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["tokens"]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="Q4_1,Q4_0,Q4_K_M,Q8_0")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--activations", default=ACTIVATIONS[0], help="kvserve's --activations (the f32 reference has none)")
    args = ap.parse_args()
    binary = build()
    rng = random.Random(args.seed)
    prompts = [f"Here is a short story about {distinct_text(rng, 3)}:" for _ in range(args.prompts)]
    out = []
    for spec in args.files.split(","):
        gguf = compared_file(spec)
        with contextlib.ExitStack() as stack:
            kv = stack.enter_context(launched_server(str(gguf), ["--speculative", "off", "--activations", args.activations]))
            exact = stack.enter_context(launched_server(str(gguf), ["--speculative", "off", "--weights", "f32"]))
            ls = stack.enter_context(llama_server(binary, gguf))
            replies = {"kvserve": [kvserve_ids(kv, p, args.tokens) for p in prompts],
                       "llama-server": [llama_ids(ls, p, args.tokens) for p in prompts],
                       "f32": [kvserve_ids(exact, p, args.tokens) for p in prompts]}
        row = {"file": gguf.name, "prompts": len(prompts), "tokens": args.tokens, "activations": args.activations}
        for a, b in (("kvserve", "llama-server"), ("kvserve", "f32"), ("llama-server", "f32")):
            prefixes = [common_prefix(x, y) for x, y in zip(replies[a], replies[b])]
            row[f"{a} vs {b}"] = {"mean_common_prefix": round(statistics.fmean(prefixes), 1),
                                  "median_common_prefix": statistics.median(prefixes),
                                  "all_equal_share": round(sum(x == y for x, y in zip(replies[a], replies[b])) / len(prompts), 2),
                                  "prefixes": prefixes}
        out.append(row)
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    print(json.dumps({"results": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
