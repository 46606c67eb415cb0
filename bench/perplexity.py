"""Perplexity on a text Debian ships, kvserve beside llama.cpp's llama-perplexity, on the same GGUF files.
Prints JSON.

    python bench/perplexity.py [--files Q4_1,Q4_0,Q4_K_M,Q8_0] [--text /usr/share/common-licenses/GPL-3]
                               [--activations int8,int16]

llama-perplexity's method, repeated through kvserve's HTTP API: the text is tokenized once (llama-server's
/tokenize on the same file, so both score the same ids), cut into chunks of --ctx tokens, and each chunk
scored alone, counting the negative log-likelihood of its second half only (each of those tokens has at
least ctx/2 tokens before it). kvserve gives each token's logprob through /v1/completions with `echo`
and `logprobs`. Files are named as in bench/compare_llamacpp.py --file.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare_llamacpp import SERVED, compared_file  # noqa: E402
from launch import launched_server  # noqa: E402
from llama_server import build, llama_server, tool  # noqa: E402

from models.quant import ACTIVATIONS  # noqa: E402


def llama_perplexity(path: Path, text: Path, ctx: int, threads: int) -> float:
    done = subprocess.run([str(tool("llama-perplexity")), "-m", str(path), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
                           "-t", str(threads)], capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr).group(1))


def token_ids(path: Path, text: str) -> list[int]:
    with llama_server(build(quiet=True), path) as url:
        return httpx.post(url + "/tokenize", json={"content": text, "add_special": True}, timeout=300).json()["tokens"]


def kvserve_perplexity(path: Path, ids: list[int], ctx: int, activations: str) -> float:
    nll, count = 0.0, 0
    with launched_server(str(path), ["--served-model-name", SERVED, "--activations", activations, "--speculative", "off"]) as url:
        for start in range(0, len(ids) - ctx + 1, ctx):
            chunk = ids[start : start + ctx]
            body = {"model": SERVED, "prompt": chunk, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
            logprobs = httpx.post(url + "/v1/completions", json=body, timeout=600).json()["choices"][0]["logprobs"]["token_logprobs"]
            scored = logprobs[ctx // 2 + 1 : ctx]  # tokens ctx/2 + 1 .. ctx - 1, each after at least ctx/2 others
            nll -= sum(scored)
            count += len(scored)
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="Q4_1,Q4_0,Q4_K_M,Q8_0")
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", default=ACTIVATIONS[0], help="kvserve's --activations, one column each (int8,int16)")
    args = ap.parse_args()
    text = Path(args.text)
    rows = []
    for spec in args.files.split(","):
        path = compared_file(spec)
        ids = token_ids(path, text.read_text())
        row = {"file": path.name, "tokens": len(ids), "llama_perplexity": llama_perplexity(path, text, args.ctx, args.threads)}
        for acts in args.activations.split(","):
            name = f"kvserve_{acts}"
            row[name] = round(kvserve_perplexity(path, ids, args.ctx, acts), 4)
            row[f"{name}_over_llama"] = round(row[name] / row["llama_perplexity"], 4)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    print(json.dumps({"text": str(text), "ctx": args.ctx, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
