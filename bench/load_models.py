"""Loading random-weight 1B and 3B models, kvserve beside llama-server, on the same GGUF files. Prints JSON.

    python bench/load_models.py [--sizes 1b,3b] [--formats Q4_K_M,Q4_0,Q8_0] [--serve-tokens 32]

Each file is written once into the cache folder (bench-models/): Llama-3.2-1B's or -3B's shape, SmolLM2's
tokenizer, numbers from a fixed seed, written as F16 with gguf-py, then quantized by llama.cpp's own
llama-quantize; 8b (Llama-3.1-8B's shape, Q4_K_M only) is written as random Q4_K and Q6_K blocks directly. For each file and server it records the time from start to a healthy /health, the peak
RSS while loading (VmHWM) and the RSS at idle, then one greedy reply of --serve-tokens tokens (its
tokens/s). kvserve is started cold (a cache folder without the file's artifact: it reads the GGUF and
exports) and then warm (the artifact saved by the cold start).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from llama_server import build, tool  # noqa: E402

from models.catalog import cache_dir, fetch  # noqa: E402
from server.local import free_port  # noqa: E402
from tests.models.gguf_files import llama_writer, write_llama_gguf  # noqa: E402

SHAPES = {  # Llama-3.2's
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn=8192),
    "3b": dict(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, ffn=8192),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn=14336),
}


# Q4_K_M's choice of types by tensor (llama-quantize gives Q6_K to half the attn_v and ffn_down; all of them here)
Q4_K_M = {"token_embd": "Q4_K", "output": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "*": "Q4_K"}


def model_file(size: str, fmt: str) -> Path:
    folder = cache_dir() / "bench-models"
    folder.mkdir(parents=True, exist_ok=True)
    if size == "8b":  # 16 GB of F16 to quantize: its Q4_K_M blocks are written as random blocks instead
        assert fmt == "Q4_K_M", "the 8B file is Q4_K_M only"
        out = folder / "llama-8b-random-Q4_K_M.gguf"
        if not out.is_file():
            write_llama_gguf(out.with_suffix(".tmp"), fetch("smollm2-135m-instruct"), types=Q4_K_M, seed=1, context=8192,
                             tied=False, **SHAPES[size])
            out.with_suffix(".tmp").rename(out)
        return out
    f16 = folder / f"llama-{size}-random-F16.gguf"
    if not f16.is_file():
        tmp = f16.with_suffix(".tmp")
        write_llama_gguf(tmp, fetch("smollm2-135m-instruct"), types="F16", seed=1, context=8192, **SHAPES[size])
        tmp.rename(f16)
    if fmt == "F16":
        return f16
    out = folder / f"llama-{size}-random-{fmt}.gguf"
    return out if out.is_file() else quantized(f16, out, fmt)


# SmolLM2-135M's 30 layers at Llama-3.2-1B's width and heads: each layer's FFN cut so that a token reads
# as many weights as Llama-3.2-1B's 16 layers do (30 x 32.5M = 16 x 60.8M)
WIDENED = dict(dim=2048, n_heads=32, n_kv_heads=8, ffn=3584)


def quantized(f16: Path, out: Path, fmt: str) -> Path:
    """`f16` as `fmt` at `out`, by llama.cpp's llama-quantize (written whole, then renamed)."""
    subprocess.run([str(tool("llama-quantize")), str(f16), str(out.with_suffix(".tmp")), fmt, "2"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out.with_suffix(".tmp").rename(out)
    return out


def copying_model_file(fmt: str) -> Path:
    """A model that costs a 1B's reads per token and still writes like SmolLM2 (it copies, so n-gram drafts
    land): SmolLM2-135M-Instruct's weights, widened with zeros. Its heads keep their key-value groups, its
    norms are rescaled for the wider mean (weights by sqrt(576/2048), epsilon by 576/2048), and the extra
    rows and columns are zero, which every block format holds exactly, so the extra width stays zero."""
    folder = cache_dir() / "bench-models"
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"smollm2-widened-1b-{fmt}.gguf"
    if out.is_file():
        return out
    import gguf
    import numpy as np

    source = fetch("smollm2-135m-instruct")
    reader = gguf.GGUFReader(str(source))
    field = {name: f.contents() for name, f in reader.fields.items() if name.startswith("llama.")}
    dim, heads, kv_heads = (field[f"llama.{k}"] for k in ("embedding_length", "attention.head_count", "attention.head_count_kv"))
    W, head_dim, group = WIDENED, dim // heads, heads // kv_heads
    share = dim / W["dim"]
    f16 = out.with_name(out.stem + ".F16.tmp")
    writer, _ = llama_writer(f16, source, n_layers=field["llama.block_count"], context=field["llama.context_length"],
                             rope_base=field["llama.rope.freq_base"],
                             rms_eps=field["llama.attention.layer_norm_rms_epsilon"] * share, name=out.stem, **W)
    # q head h goes where its key-value group sits in the wider grouping; key-value heads keep their places
    q_at = [h // group * (W["n_heads"] // W["n_kv_heads"]) + h % group for h in range(heads)]

    def heads_placed(a: np.ndarray, at: list[int], n_new: int, cols: int) -> np.ndarray:  # head blocks of rows
        wide = np.zeros((n_new * head_dim, cols), np.float32)
        for old, new in enumerate(at):
            wide[new * head_dim:(new + 1) * head_dim, : a.shape[1]] = a[old * head_dim:(old + 1) * head_dim]
        return wide

    def padded(a: np.ndarray, rows: int, cols: int) -> np.ndarray:
        wide = np.zeros((rows, cols), np.float32)
        wide[: a.shape[0], : a.shape[1]] = a
        return wide

    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        kind = t.name.split(".")[-2]
        if a.ndim == 1:  # a norm's weights
            wide = padded(a[None] * share ** 0.5, 1, W["dim"])[0]
        elif kind == "attn_q":
            wide = heads_placed(a, q_at, W["n_heads"], W["dim"])
        elif kind in ("attn_k", "attn_v"):
            wide = heads_placed(a, list(range(kv_heads)), W["n_kv_heads"], W["dim"])
        elif kind == "attn_output":  # its columns are the q heads'
            wide = padded(heads_placed(a.T, q_at, W["n_heads"], dim).T, W["dim"], W["n_heads"] * head_dim)
        elif kind in ("ffn_gate", "ffn_up"):
            wide = padded(a, W["ffn"], W["dim"])
        elif kind == "ffn_down":
            wide = padded(a, W["dim"], W["ffn"])
        else:  # token_embd
            wide = padded(a, a.shape[0], W["dim"])
        writer.add_tensor(t.name, wide.astype(np.float16 if wide.ndim > 1 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if fmt == "F16":
        return f16.rename(out)
    quantized(f16, out, fmt)
    f16.unlink()
    return out


def memory(pid: int) -> dict:
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status"))
    return {"peak_rss_mb": int(fields["VmHWM"].split()[0]) // 1024, "rss_mb": int(fields["VmRSS"].split()[0]) // 1024}


def measured(cmd: list[str], port: int, tokens: int, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        loaded = memory(proc.pid)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        t1 = time.perf_counter()
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=1800).json()
        took = time.perf_counter() - t1
        if "usage" not in reply:
            raise RuntimeError(f"{cmd[0]} answered {reply}")
        n = reply["usage"]["completion_tokens"]
        time.sleep(1)
        return {"ready_s": round(ready, 2), "peak_rss_mb": loaded["peak_rss_mb"], "idle_rss_mb": memory(proc.pid)["rss_mb"],
                "reply_tokens": n, "reply_tok_s": round(n / took, 2)}
    finally:
        proc.terminate()
        proc.wait(timeout=120)


def kvserve(path: Path, cache: Path, tokens: int) -> dict:
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}, "KVSERVE_CACHE": str(cache)}
    cmd = [sys.executable, "-m", "server.cli", "serve", "--model", str(path), "--port", str(port), "--log-level", "warning"]
    return measured(cmd, port, tokens, env)


def llama(path: Path, tokens: int) -> dict:
    port = free_port()
    cmd = [str(build(quiet=True)), "-m", str(path), "--port", str(port), "-t", "2", "-np", "8", "-c", "16384", "--cont-batching"]
    return measured(cmd, port, tokens)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1b,3b")
    ap.add_argument("--formats", default="Q4_K_M,Q4_0,Q8_0")
    ap.add_argument("--serve-tokens", type=int, default=32)
    args = ap.parse_args()
    results = []
    for size in args.sizes.split(","):
        for fmt in args.formats.split(","):
            path = model_file(size, fmt)
            with tempfile.TemporaryDirectory(prefix="kvserve-cache-") as tmp:
                cache = Path(tmp)
                shutil.copytree(cache_dir() / "native", cache / "native")  # the built kernels, not the artifacts
                row = {"size": size, "format": fmt, "file_mb": path.stat().st_size // 2**20,
                       "kvserve_cold": kvserve(path, cache, args.serve_tokens),
                       "kvserve_warm": kvserve(path, cache, args.serve_tokens),
                       "llama_server": llama(path, args.serve_tokens)}
            print(json.dumps(row), file=sys.stderr)
            results.append(row)
    print(json.dumps({"results": results}, indent=2))


if __name__ == "__main__":
    main()
