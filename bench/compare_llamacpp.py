"""kvserve against llama.cpp's llama-server, side by side: same GGUF, same threads, both up at once, each
load taken in turns (the order reversed every round), in one window.

    python bench/compare_llamacpp.py --server [--file Q4_0] [--rounds 2] [--loads streams,prefill,multiturn,long]
    make compare COMPARE_ARGS="--file Q4_K_M"

Both servers load the same file (--file): SmolLM2-135M's own Q4_1, or that model requantized by
llama-quantize (made once, beside it), the random-weight 1B/3B files of bench/load_models.py, or the
real-size mixture-of-experts files of bench/moe_files.py (qwen3-30b-a3b, gpt-oss-20b), which two servers
cannot hold at once in 24 GB: `--one-at-a-time` starts each server in turn, every round.
--server builds llama-server once (bench/llama_server.py) and runs it with `-t 2 --cont-batching` and, for
each load, `-np` as many as the load's concurrent requests (3,072 tokens a slot), restarting it between
loads that differ. The loads, all streamed and greedy:
- streams: 1, 8 and 32 concurrent streams of distinct short prompts (output tok/s, ITL);
- prefill: one 1,000-token prompt no server has seen, one token of reply (prompt tok/s);
- multiturn: bench/multiturn.py, 32 users x 6 turns, the history resent, no sessions (tok/s, TTFT);
- long: 32 conversations with 2,000-token histories, each history sent once first (untimed), then all
  32 decode 64 tokens together (output tok/s, ITL).
kvserve runs with `--speculative off` unless --speculative is given, so that both decode one token a
step; bench/speculation.py measures what drafting adds. Just before each server's one-stream load, both
servers idle, the bus is measured as the median rate of summing a tensor of token_bytes, at most 1 GiB
(bench/bandwidth.py `typical`): the bytes a token reads (every weight once, of a MoE's experts those
it uses: token_bytes) over the stream's median inter-token latency, divided by that, is the fraction of
the bus a step reads at (each round's, and their median; the same with output tok/s, which holds the prompts' prefill too, as `..._with_prefill`). The
best rate of the round's 256 MiB sums is kept beside them (`read_gb_s`).
Prints JSON: the CPU (name, family, model, the instruction sets the kernels choose between), every run,
the medians, and kvserve / llama-server for each figure.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
import bandwidth  # noqa: E402
import multiturn  # noqa: E402
from launch import launched_server, warm_up  # noqa: E402
from llama_server import SLOT_TOKENS, build, slots_matched, tool  # noqa: E402
from load_models import SHAPES, model_file  # noqa: E402
from moe_files import SPECS as MOE_SPECS  # noqa: E402
from moe_files import moe_file  # noqa: E402
from serve_bench import WORDS, make_requests, run_level, summary  # noqa: E402

from models import DEFAULT_MODEL  # noqa: E402
from models.catalog import fetch  # noqa: E402
from tests.models.gguf_files import requantized_copy  # noqa: E402

LOADS = ("streams", "prefill", "multiturn", "long")
SERVED = "compared"  # the name kvserve serves the file under (llama-server takes any)


ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile",
             "amx_int8", "amx_bf16")


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def cpu_record() -> dict:
    """What the figures were measured on: the CPU's name, family and model (AMD's family 25 is Zen 3 and
    4, 26 Zen 5), and which of the instruction sets the kernels choose between it has."""
    fields: dict[str, str] = {}
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if not key.strip():
                break  # the first processor's block is enough
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return {"name": cpu_name(), "vendor": fields.get("vendor_id"), "family": fields.get("cpu family"),
            "model": fields.get("model"), "isa": [f for f in ISA_FLAGS if f in flags]}


def distinct_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


# A runner takes url(slots): the server's URL for a load of `slots` concurrent requests.
def streams(url, args, rnd: int) -> dict:
    out = {}
    for c in (1, 8, 32):
        n, length = (4, 128) if c == 1 else (2 * c, 64)
        at = url(c)
        # In this minute, over at most 1 GiB: far past the caches, and room beside a served model the size of RAM.
        bus = {"read_gb_s": bandwidth.typical(min(args.token_bytes, 2**30), args.threads)} if c == 1 else {}
        report = asyncio.run(run_level(at, SERVED, make_requests(n, 32, length, 0.0, args.seed + rnd), c, None, 0))
        out[f"{c}_streams"] = {"output_tok_s": report["output_tok_s"], "itl_p50_ms": report["itl_ms"].get("p50"),
                               "itl_p99_ms": report["itl_ms"].get("p99"), "failed": report["failed"], **bus}
    return out


def prefill(url, args, rnd: int) -> dict:
    """A prompt of about args.prefill_tokens tokens, unseen by either server (seeded by round and server)."""
    at = url(1)
    rng = random.Random(f"{args.seed}-{rnd}-{at}")
    body = {"model": SERVED, "prompt": distinct_text(rng, args.prefill_tokens), "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    r = httpx.post(at + "/v1/completions", json=body, timeout=600)
    wall = time.perf_counter() - start
    r.raise_for_status()
    tokens = r.json()["usage"]["prompt_tokens"]
    return {"prefill": {"prompt_tokens": tokens, "prompt_tok_s": round(tokens / wall, 1), "failed": 0}}


def multi(url, args, rnd: int) -> dict:
    load = argparse.Namespace(url=url(args.users), model=SERVED, users=args.users, turns=args.turns, sessions=False,
                              first_words=30, turn_words=20, output_len=48, seed=args.seed + rnd)
    report = asyncio.run(multiturn.run(load))
    return {"multiturn": {"output_tok_s": report["output_tok_s"], "failed": report["failed"],
                          "ttft_p50_last_two_turns_ms": report["ttft_ms_last_two_turns"].get("p50")}}


def long(url, args, rnd: int) -> dict:
    at = url(args.long_users)
    rng = random.Random(f"{args.seed}-{rnd}-long-{at}")
    prompts = [distinct_text(rng, args.history_tokens) for _ in range(args.long_users)]  # a word is a token here

    async def go():
        async with httpx.AsyncClient(timeout=1800) as client:
            gate = asyncio.Semaphore(8)

            async def warm(p):  # the history, sent once: what a chat's earlier turns leave behind
                async with gate:
                    r = await client.post(at + "/v1/completions", json={"model": SERVED, "prompt": p, "max_tokens": 1})
                    r.raise_for_status()
                    return r.json()["usage"]["prompt_tokens"]
            return await asyncio.gather(*(warm(p) for p in prompts))
    lengths = asyncio.run(go())
    requests = [(p, args.long_output) for p in prompts]
    report = asyncio.run(run_level(at, SERVED, requests, args.long_users, None, 0))
    return {"long": {"history_tokens": round(statistics.fmean(lengths)), "output_tok_s": report["output_tok_s"],
                     "itl_p50_ms": report["itl_ms"].get("p50"), "itl_p99_ms": report["itl_ms"].get("p99"),
                     "failed": report["failed"]}}


RUNNERS = {"streams": streams, "prefill": prefill, "multiturn": multi, "long": long}


def medians(runs: list[dict]) -> dict:
    """{load: {figure: median over rounds}} of one server's runs."""
    out: dict = {}
    for run in runs:
        for load, figures in run.items():
            for key, value in figures.items():
                if isinstance(value, (int, float)) and value is not None:
                    out.setdefault(load, {}).setdefault(key, []).append(value)
    return {load: {k: round(statistics.median(v), 2) for k, v in figs.items()} for load, figs in out.items()}


def ratios(kv: dict, ls: dict) -> dict:
    """kvserve / llama-server for rates (higher is better); llama-server / kvserve for latencies."""
    out = {}
    for load, figs in kv.items():
        for key, value in figs.items():
            other = ls.get(load, {}).get(key)
            if not other or not value or key in ("failed", "prompt_tokens", "history_tokens", "read_gb_s"):
                continue
            out[f"{load}.{key}"] = round(other / value if key.endswith("_ms") else value / other, 2)
    return out


@contextlib.contextmanager
def kvserve_urls(gguf: Path, serve_args: list[str]):
    """kvserve on the file, warmed up: url(slots), the same server whatever the load (its batch follows it)."""
    with launched_server(str(gguf), serve_args) as url:
        warm_up(url)
        yield lambda slots: url


def token_bytes(gguf: Path) -> int:
    """The bytes of weights one token reads: the file's tensors, of a mixture of experts' 3-D expert tensors
    the share of the experts a token uses, the embedding table only where the lm_head reads it (tied)."""
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(str(gguf))
    arch = reader.fields["general.architecture"].contents()
    share = 1.0
    if f"{arch}.expert_count" in reader.fields:
        share = reader.fields[f"{arch}.expert_used_count"].contents() / reader.fields[f"{arch}.expert_count"].contents()
    tied = not any(t.name == "output.weight" for t in reader.tensors)  # else a token reads one row of the table
    return int(sum(t.n_bytes * (share if "_exps." in t.name else 1.0) for t in reader.tensors
                   if tied or t.name != "token_embd.weight"))


def compared_file(spec: str) -> Path:
    """--file -> the GGUF path, made first if it is one of the named variants."""
    own = fetch(DEFAULT_MODEL, quiet=True)
    if spec == "Q4_1":
        return own
    if spec in MOE_SPECS:
        return moe_file(spec)
    if spec.split("-")[0] in SHAPES:
        size, fmt = spec.split("-", 1)
        return model_file(size, fmt)
    if Path(spec).is_file():
        return Path(spec)
    return requantized_copy(own, own.parent / own.name.replace("Q4_1", spec), spec, tool("llama-quantize"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="store_true", help="against llama-server, built here once (the only mode)")
    ap.add_argument("--llama-server", default=None, help="a llama-server binary to use instead of building one")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loads", default=",".join(LOADS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--long-users", type=int, default=32)
    ap.add_argument("--history-tokens", type=int, default=2000)
    ap.add_argument("--long-output", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slot-tokens", type=int, default=SLOT_TOKENS,
                    help="llama-server's context a slot (-c is this times -np): 32 slots of 3,072 tokens of "
                         "Qwen3-30B-A3B's KV (96 KiB a token) and its 17 GB do not fit 24 GB")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="one server up at a time, each round (for files two copies of which do not fit in memory)")
    ap.add_argument("--speculative", action="store_true",
                    help="kvserve drafts as it does by default; without it, both servers decode one token a step")
    ap.add_argument("--serve-args", default="", help="extra arguments for the launched kvserve")
    ap.add_argument("--file", default="Q4_1", help="the GGUF both servers load: SmolLM2-135M's own Q4_1, that model "
                    "requantized by llama-quantize (Q4_0, Q4_K_M, Q8_0, ...), 1b-Q4_K_M / 3b-Q4_K_M (random weights, "
                    "bench/load_models.py), qwen3-30b-a3b (Q4_K_M) / gpt-oss-20b (MXFP4) (random weights at the real "
                    "size, bench/moe_files.py), or a path")
    args = ap.parse_args()
    loads = [load for load in args.loads.split(",") if load]
    if unknown := set(loads) - set(LOADS):
        ap.error(f"unknown loads {sorted(unknown)}; choose from {','.join(LOADS)}")
    binary = args.llama_server or build()
    gguf = compared_file(args.file)
    args.file_bytes = gguf.stat().st_size
    args.token_bytes = token_bytes(gguf)
    runs: dict[str, list[dict]] = {"kvserve": [], "llama-server": []}
    reads: list[float] = []  # GB/s, once a round with both servers idle: the machine's bandwidth drifts
    serve_args = ["--served-model-name", SERVED, *args.serve_args.split(), *([] if args.speculative else ["--speculative", "off"])]
    servers = {"kvserve": lambda: kvserve_urls(gguf, serve_args),
               "llama-server": lambda: slots_matched(binary, gguf, threads=args.threads, slot_tokens=args.slot_tokens)}
    with contextlib.ExitStack() as stack:
        # both up at once, unless asked to take turns (two copies of a 17 GB file do not fit 24 GB)
        urls = {} if args.one_at_a_time else {name: stack.enter_context(start()) for name, start in servers.items()}
        for rnd in range(args.rounds):
            order = list(servers) if rnd % 2 == 0 else list(servers)[::-1]
            results = {name: {} for name in servers}
            reads.append(bandwidth.measure(threads=(args.threads,))[str(args.threads)])
            for name in order if args.one_at_a_time else [None]:
                with servers[name]() if name else contextlib.nullcontext() as alone:
                    for load in loads:
                        for each in [name] if name else order:
                            results[each].update(RUNNERS[load](alone or urls[each], args, rnd))
                            print(json.dumps({"round": rnd, "server": each, "load": load}), file=sys.stderr, flush=True)
            for name in servers:
                runs[name].append(results[name])
    med = {name: medians(r) for name, r in runs.items()}
    report = {"gguf": gguf.name, "file_mb": gguf.stat().st_size // 2**20, "token_mb": args.token_bytes // 2**20, "machine": cpu_name(), "cpu": cpu_record(), "threads": args.threads,
              "kvserve_speculative": args.speculative, "rounds": args.rounds, "read_gb_s": reads, "runs": runs, "median": med,
              "kvserve_over_llama_server": ratios(med["kvserve"], med["llama-server"])}
    for name, rs in runs.items():  # a token reads token_bytes: every weight once, of the experts those it uses
        ones = [run.get("1_streams", {}) for run in rs]
        if ones and all(o.get("itl_p50_ms") and o.get("read_gb_s") for o in ones):
            step = [args.token_bytes / (o["itl_p50_ms"] / 1e3) / (o["read_gb_s"] * 1e9) for o in ones]
            whole = [args.token_bytes * o["output_tok_s"] / (o["read_gb_s"] * 1e9) for o in ones]
            report[f"{name}_one_stream_fraction_of_bandwidth"] = round(statistics.median(step), 3)
            report[f"{name}_one_stream_fraction_runs"] = [round(f, 3) for f in step]
            report[f"{name}_one_stream_fraction_with_prefill"] = round(statistics.median(whole), 3)
    print(json.dumps(report, indent=2))
    failed = sum(f.get("failed", 0) for r in runs.values() for run in r for f in run.values())
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
