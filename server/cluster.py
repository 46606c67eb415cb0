"""`kvserve cluster`: N `kvserve serve` replicas on loopback, each pinned to its own cores and publishing
its KV events, behind vllm-router (the `cluster` extra), which routes each request to the replica that
holds most of its prefix (kv_aware). nginx fronts it where installed, so that every error a client
gets is kvserve's JSON; with --nginx it also sends session traffic straight to the session's replica
(server/cluster_front.py). It launches, watches and stops processes; the routing is the router's and
nginx's (docs/scaling.md).

A replica that dies is reported and left out: the router's health checks stop sending to it, and the
others go on. It is not restarted: its sessions moved to the next replica in nginx's ring (by a shared
--kv-disk), and every request for them would hash back to it, only to be relayed to their new holder.

The replicas are each other's --peers (server/api/peers.py). On a shared --kv-disk, no request for a
session is then answered 409 because another replica holds it, and a restarted cluster's sessions wait on
disk for their first request, which takes each up on the replica it reaches.

The cluster's /health is its own (server/cluster_health.py): 200 while any replica serves. Every line a
replica, the router or nginx writes comes out of this process tagged with its name ("[replica 2] ...").

SIGTERM drains the cluster as one server drains: the front door stops taking connections, the replicas
finish what runs within their --shutdown-timeout, and only then do the router and nginx, which carry
those answers' last bytes, stop (`drain`)."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvcache.block_pool import DEFAULT_BLOCK_SIZE
from models.catalog import NAMED_MODELS, fetch

from .cluster_front import nginx_binary, start_nginx
from .cluster_health import ClusterHealth, serve_health
from .config import ServerConfig
from .listener import allowed_hosts, origin_list
from .local import exit_now, free_port, wait_healthy

POLICIES = ("kv_aware", "cache_aware", "round_robin", "consistent_hash", "power_of_two", "random")
SESSION_TTL_S = 3600  # the router keeps a session on its replica until it has been idle this long
# A dead replica must leave the rotation in seconds, not the router's default minutes: until then every
# request routed to it fails once and is retried on another.
HEALTH_FLAGS = ["--health-check-interval-secs", "1", "--health-check-timeout-secs", "2", "--health-failure-threshold", "2",
                "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "30"]
# vllm-router allows every origin unless given a list, and kvserve allows none unless told: a list of
# one origin that cannot exist (.invalid is reserved, RFC 2606) makes the router allow none either
NO_ORIGIN = "https://no-origin.invalid"
# of the second past --shutdown-timeout a cluster may take to exit: the router's and nginx's last bytes after
# the replicas have gone, then a kill for whatever still runs
GRACE_S = 0.8


@dataclass(frozen=True)
class Replica:
    url: str
    events: str  # tcp://127.0.0.1:PORT, its KV event publisher
    replay: str  # and the socket that resends batches a router missed
    cores: tuple[int, ...]


def core_sets(n: int, per: int | None) -> list[tuple[int, ...]]:
    """n disjoint sets of `per` cores (default: an even share), wrapping round when there are too few."""
    cores = sorted(os.sched_getaffinity(0))
    per = per or max(1, len(cores) // n)
    return [tuple(cores[(i * per + j) % len(cores)] for j in range(per)) for i in range(n)]


def allowed_origins(serve_args: list[str]) -> list[str]:
    """The replicas' --allowed-origins, repeated or comma-separated, as `kvserve serve` reads them."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--allowed-origins", action="append", default=[])
    return list(origin_list(p.parse_known_args(serve_args)[0].allowed_origins))


def shutdown_timeout(serve_args: list[str]) -> float:
    """The replicas' --shutdown-timeout, as `kvserve serve` reads it."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--shutdown-timeout", type=float, default=ServerConfig().shutdown_timeout)
    return p.parse_known_args(serve_args)[0].shutdown_timeout


def router_command(binary: str, host: str, port: int, replicas: list[Replica], policy: str, model: str,
                   origins: list[str] = ()) -> list[str]:
    # its metrics on a free loopback port: at its fixed default, a second cluster on the host could not start
    cmd = [binary, "--host", host, "--port", str(port), "--policy", policy, "--worker-urls", *(r.url for r in replicas),
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
           *HEALTH_FLAGS]
    if "*" not in origins:  # with '*' the router's default (any origin) is the replicas' rule already
        cmd += ["--cors-allowed-origins", *(origins or [NO_ORIGIN])]
    if policy == "kv_aware":
        for r in replicas:
            cmd += ["--kv-event-source", f"{r.url}={r.events}", "--kv-event-replay-source", f"{r.url}={r.replay}"]
        # a replica's blocks are in RAM, the memory it computes from: the router's host tier, credited in full
        cmd += ["--kv-event-block-size", str(DEFAULT_BLOCK_SIZE), "--kv-event-model", model, "--kv-penalty-host", "1.0",
                "--kv-aware-session-affinity-ttl-secs", str(SESSION_TTL_S)]
    return cmd


PIPES = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}


def tag_output(proc: subprocess.Popen, name: str) -> subprocess.Popen:
    """Copies each line `proc` writes (started with PIPES) to this process's stdout or stderr, prefixed
    with `[name] `: N replicas' logs interleave, and an untagged line could be any of them's."""
    def copy(source, sink) -> None:
        for line in iter(source.readline, b""):
            sink.buffer.write(b"[" + name.encode() + b"] " + line)
            sink.flush()
    for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
        threading.Thread(target=copy, args=(source, sink), name=f"log {name}", daemon=True).start()
    return proc


def start(n: int, per: int | None, serve_args: list[str], model: str) -> tuple[list[Replica], list[subprocess.Popen]]:
    replicas = [Replica(f"http://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}",
                        cores) for cores in core_sets(n, per)]
    # each knows the others: a request for a session another replica holds (a Responses chain the router sent
    # elsewhere, a session made through the router) goes there, and a restart leaves sessions on the shared
    # --kv-disk until a request names one, so each lands on the replica the front door sends it to
    peers = ",".join(r.url for r in replicas)
    procs = []
    for i, r in enumerate(replicas, start=1):
        cmd = [sys.executable, "-m", "server.cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", r.url.rsplit(":", 1)[1], "--kv-events", r.events, "--kv-events-replay", r.replay,
               "--peers", peers, *serve_args]
        env = {**os.environ, "OMP_NUM_THREADS": str(len(r.cores))}
        procs.append(tag_output(subprocess.Popen(cmd, env=env, preexec_fn=lambda c=r.cores: os.sched_setaffinity(0, c),
                                                 **PIPES), f"replica {i}"))
    return replicas, procs


def router_binary() -> str:
    binary = shutil.which("vllm-router") or os.path.join(os.path.dirname(sys.executable), "vllm-router")
    if not os.path.exists(binary):
        raise OSError("vllm-router is not installed: pip install 'kvserve[cluster]'")
    return binary


def watch(done: threading.Event, replicas: list[Replica], procs: list[subprocess.Popen]) -> int:
    """Until SIGTERM -> 0; or until the router, nginx or the last replica exits -> 1."""
    dead: set[int] = set()
    while not done.wait(1):
        for i, (r, p) in enumerate(zip(replicas, procs)):
            if i not in dead and p.poll() is not None:
                dead.add(i)
                print(f"replica {r.url} exited with {p.returncode}; {len(replicas) - len(dead)} of {len(replicas)} "
                      "replicas serve on", file=sys.stderr, flush=True)
        if len(dead) == len(replicas) or any(p.poll() is not None for p in procs[len(replicas):]):
            print("kvserve cluster: the router, nginx or every replica exited; stopping the rest", file=sys.stderr, flush=True)
            return 1
    return 0


def drain(replicas: list[subprocess.Popen], router: subprocess.Popen | None, nginx: subprocess.Popen | None,
          timeout: float) -> None:
    """Stops the cluster without cutting a request: the front door (nginx, else the router) stops taking
    connections at once, the replicas drain within `timeout`, then the router and nginx end, once what they
    carry is through; anything still running `timeout` + GRACE_S after the start is killed."""
    deadline = time.monotonic() + timeout + GRACE_S
    if nginx is not None:
        signal_alive(nginx, signal.SIGQUIT)  # nginx's graceful stop: its listener closes, open requests finish
    elif router is not None:
        signal_alive(router, signal.SIGTERM)  # the router's own graceful stop, likewise
    for p in replicas:
        signal_alive(p, signal.SIGTERM)  # each drains: new work gets 503, what runs finishes or ends
    wait_until(replicas, deadline)
    if router is not None:
        signal_alive(router, signal.SIGTERM)
    wait_until([p for p in (router, nginx) if p is not None], deadline)
    for p in (*replicas, router, nginx):
        if p is not None and p.poll() is None:
            print(f"kvserve cluster: pid {p.pid} still ran {timeout + GRACE_S:.1f}s after the signal; killed",
                  file=sys.stderr, flush=True)
            p.kill()
            p.wait()


def signal_alive(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        p.send_signal(sig)


def wait_until(procs: list[subprocess.Popen], deadline: float) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return


def cmd_cluster(args) -> int:
    binary = router_binary()
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if args.model in NAMED_MODELS:
        fetch(args.model)  # once, before N replicas would each download it on a first start
    if allowed_hosts(args.host, ()) is None:  # the front door faces the network: replicas answer its Host names
        serve_args = ["--allowed-hosts", "*", *serve_args]
    front = nginx_binary()  # nginx turns every 5xx into kvserve's JSON; without it the router's are plain text
    if front is None and args.nginx:
        print("kvserve cluster: nginx is not installed (Debian: apt-get install nginx-light); --nginx needs it",
              file=sys.stderr, flush=True)
        return 2
    if front is None:
        print("kvserve cluster: nginx is not installed, so the router holds the port and its own errors are plain "
              "text (Debian: apt-get install nginx-light)", file=sys.stderr, flush=True)
    replicas, procs = start(args.replicas, args.cores_per_replica, serve_args, args.model)
    work = health = router = nginx = None
    try:
        health = serve_health(ClusterHealth([r.url for r in replicas]), "127.0.0.1", args.health_port or free_port())
        health_at = "127.0.0.1:%d" % health.server_address[1]
        for r, p in zip(replicas, procs):
            wait_healthy(r.url, 600, p)
        router_port = free_port() if front else args.port
        router_host = "127.0.0.1" if front else args.host
        router = tag_output(subprocess.Popen(router_command(binary, router_host, router_port, replicas, args.policy,
                                                            args.model, allowed_origins(serve_args)), **PIPES), "router")
        procs.append(router)
        wait_healthy(f"http://{router_host}:{router_port}", 120, procs[-1])
        if front:
            work = Path(tempfile.mkdtemp(prefix="kvserve-nginx-"))
            nginx = tag_output(start_nginx(front, work, f"{args.host}:{args.port}", f"127.0.0.1:{router_port}",
                                           [r.url.removeprefix("http://") for r in replicas], health_at, args.nginx,
                                           **PIPES), "nginx")
            procs.append(nginx)
        url = f"http://{args.host}:{args.port}"
        wait_healthy(url, 60, procs[-1])
        for r, p in zip(replicas, procs):
            print(f"replica {r.url} on cores {','.join(map(str, r.cores))}, pid {p.pid}, KV events {r.events}", flush=True)
        # without nginx the router holds the public port, and its /health is 503 once any replica is dead
        print(f"cluster health on {url if front else 'http://' + health_at}/health", flush=True)
        behind = "" if not front else ", behind nginx for sessions," if args.nginx else ", behind nginx,"
        print(f"router ({args.policy}){behind} on {url}", flush=True)
        code = watch(done, replicas, procs)
    finally:
        drain(procs[:len(replicas)], router, nginx, shutdown_timeout(serve_args))
        if health is not None:
            health.shutdown()
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    exit_now(code)  # all is stopped: the interpreter's teardown of torch's modules would only add seconds


def add_parser(sub) -> None:
    p = sub.add_parser("cluster", help="N replicas on loopback, pinned to disjoint cores, behind vllm-router")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cores-per-replica", type=int, default=None, help="default: an even share of this process's cores")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--policy", choices=POLICIES, default="kv_aware")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the cluster's port: nginx's, or the router's where nginx is missing")
    p.add_argument("--nginx", action="store_true",
                   help="nginx sends requests with a session (X-Session-Id, /v1/sessions/ID) to its replica")
    p.add_argument("--health-port", type=int, default=0,
                   help="loopback port of the cluster's own /health (200 while any replica serves); default: a free "
                        "one. Behind nginx it is also the public port's /health")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: flags for every replica's kvserve serve")
    p.set_defaults(func=cmd_cluster)
