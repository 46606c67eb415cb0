"""Replicas behind a router, measured in one run, each target on a fresh cluster, in turns.

    python bench/cluster.py                          # both parts
    python bench/cluster.py --part routing --rounds 2
    python bench/cluster.py --part threads

routing: bench/multiturn.py's load (every turn resends the history, no sessions) through --replicas
replicas behind vllm-router's kv_aware, cache_aware and round_robin policies, and behind nginx hashing
X-Session-Id (deploy/nginx/), which spreads clients without sessions evenly. For each: the aggregate
prefix hit rate (the replicas' /metrics), TTFT, output tok/s and failed requests.

threads: one replica on 2 threads against 2 replicas on 1 thread each behind kv_aware, at 32 streams
of distinct prompts (bench/serve_bench.py's load).

Prints JSON: every run, then the median of each target over the rounds.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
import multiturn  # noqa: E402
from launch import launched_cluster, launched_server, running  # noqa: E402
from serve_bench import make_requests, run_level  # noqa: E402

from server.cluster_front import nginx_binary  # noqa: E402
from server.local import free_port  # noqa: E402

ROUTING = ("kv_aware", "cache_aware", "round_robin", "nginx")
ROOT = Path(__file__).resolve().parents[1]


def prefix_counts(replicas: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in replicas:
        for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("kvserve:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("kvserve:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def nginx_before(replicas: list[str]):
    """deploy/nginx/'s routing in front of the replicas, as a multi-host deployment runs it."""
    work, port = Path(tempfile.mkdtemp(prefix="kvserve-bench-nginx-")), free_port()
    routing = (ROOT / "deploy/nginx/kvserve-routing.conf").read_text().replace("listen 8080;", f"listen 127.0.0.1:{port};")
    (work / "routing.conf").write_text(routing)
    servers = "".join(f"server {u.removeprefix('http://')};\n" for u in replicas)
    (work / "nginx.conf").write_text(f"""worker_processes 1; daemon off; pid {work}/nginx.pid; error_log {work}/error.log;
events {{ worker_connections 4096; }}
http {{ access_log off; client_body_temp_path {work}/b; proxy_temp_path {work}/p; fastcgi_temp_path {work}/f;
  uwsgi_temp_path {work}/u; scgi_temp_path {work}/s; include {work}/routing.conf;
  upstream kvserve_replicas {{ hash $kvserve_session_key consistent; {servers} keepalive 32; }} }}
""")
    return running([nginx_binary(), "-c", str(work / "nginx.conf"), "-p", str(work)], port, 30)


def routing_run(target: str, args) -> dict:
    policy = "round_robin" if target == "nginx" else target  # nginx: the router is there but unused
    with launched_cluster(args.model, args.replicas, policy) as (url, replicas):
        with nginx_before(replicas) if target == "nginx" else contextlib.nullcontext(url) as front:
            load = argparse.Namespace(url=front, model=args.model, users=args.users, turns=args.turns, sessions=False,
                                      first_words=args.first_words, turn_words=args.turn_words,
                                      output_len=args.output_len, seed=args.seed)
            report = asyncio.run(multiturn.run(load))
        hits, queries = prefix_counts(replicas)
    return {"target": target, "prefix_hit_rate": round(hits / queries, 3) if queries else None,
            "output_tok_s": report["output_tok_s"], "ttft_ms_mean_all": report["ttft_ms_mean_all"],
            "ttft_ms_last_two_turns": report["ttft_ms_last_two_turns"], "failed": report["failed"],
            "duration_s": report["duration_s"]}


def threads_run(target: str, args) -> dict:
    requests = make_requests(3 * args.streams, args.input_len, args.stream_output_len, 0.2, args.seed)
    if target == "1x2":
        server = launched_server(args.model)
    else:
        server = launched_cluster(args.model, 2, "kv_aware", cores_per_replica=1)
    with server as launched:
        url = launched if isinstance(launched, str) else launched[0]
        report = asyncio.run(run_level(url, args.model, requests, args.streams, None, args.seed))
    return {"target": target, "streams": args.streams, "output_tok_s": report["output_tok_s"],
            "itl_ms": report["itl_ms"], "ttft_ms": report["ttft_ms"], "failed": report["failed"]}


def medians(runs: list[dict], keys: tuple[str, ...]) -> dict:
    out = {}
    for target in dict.fromkeys(r["target"] for r in runs):
        mine = [r for r in runs if r["target"] == target]
        out[target] = {k: round(statistics.median(r[k] for r in mine), 3) for k in keys if mine[0].get(k) is not None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--part", choices=("routing", "threads", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=1, help="each target once a round, the order turned each round")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--targets", default=",".join(ROUTING))
    ap.add_argument("--users", type=int, default=12)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-words", type=int, default=120)
    ap.add_argument("--turn-words", type=int, default=20)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--stream-output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out: dict = {"args": vars(args)}
    parts = [("routing", args.targets.split(","), routing_run, ("prefix_hit_rate", "output_tok_s", "ttft_ms_mean_all")),
             ("threads", ["1x2", "2x1"], threads_run, ("output_tok_s",))]
    for name, targets, run, keys in parts:
        if args.part not in (name, "both"):
            continue
        runs = []
        for i in range(args.rounds):
            for target in (targets if i % 2 == 0 else targets[::-1]):
                runs.append(run(target, args))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        out[name] = {"runs": runs, "median": medians(runs, keys)}
    print(json.dumps(out, indent=2))
    failed = sum(r["failed"] for part in ("routing", "threads") for r in out.get(part, {}).get("runs", []))
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
