"""nginx in front of `kvserve cluster`: with --nginx, session traffic goes straight to the replica that
holds the session, the rest to vllm-router; without it, all of it to the router. nginx fronts the cluster
whenever it is installed, for its errors (below): only where it is missing does the router hold the port.

A session lives on one replica. The router cannot keep all of a session's routes there: it forwards
`/v1/sessions/...` without the client's headers, and keys its affinity on the body's model, which a GET
or DELETE has none of (docs/scaling.md). nginx hashes the session's id instead: the `X-Session-Id` header,
else the id in `/v1/sessions/{id}/...`. A request with neither goes to the router. When a replica dies,
its sessions hash to the next one, which takes them up from a shared --kv-disk.

nginx also answers for the cluster as a whole: /health goes to the cluster's own health endpoint
(server/cluster_health.py); every 5xx a client can get, whether nginx made it (a replica gone
mid-request, no replica to connect to) or the router did (its plain-text "Backend request failed: ...
http://127.0.0.1:PORT/..."), is replaced by kvserve's JSON error in the dialect of the request's path,
as one server answers it (server/api/guard.py), never an HTML page or an internal address; and the
router's CORS headers are its own, set to agree with the replicas' --allowed-origins (server/cluster.py).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

FAIL_TIMEOUT_S = 10  # a replica that refused a connection is skipped this long before nginx tries it again
# Every 5xx is nginx's own answer (proxy_intercept_errors): the router's are plain text naming a replica's
# address, and nginx cannot tell them from a replica's JSON 5xx, which therefore reads as these too.
ERRORS = {500: "a replica failed while answering; try again",
          502: "the replica failed before it answered; try again",
          503: "no replica can take the request now; try again",
          504: "a replica did not answer in time"}
RETRY_AFTER_S = 1  # the next replica in the ring takes a dead one's sessions at once
# a path of each dialect, whose errors take its shape (server/api/guard.py `error_response`); the regexes
# that pick one for a request's path are the ones its `owns` checks
DIALECTS = {"anthropic": ("/v1/messages", "~^/v1/messages(/|$)"), "responses": ("/v1/responses", "~^/v1/responses(/|$)"),
            "ollama": ("/api/generate", "~^/api/"), "openai": ("/v1/chat/completions", "default")}


def error_body(status: int, path: str) -> str:
    """The JSON a kvserve server would answer on `path` for this status."""
    from .api.guard import error_response  # the API's modules: only when a config is written
    from .errors import ApiError

    err = ApiError(ERRORS[status])
    err.status, err.kind = status, "server_error" if status == 500 else "unavailable_error"
    return error_response(err, path).body.decode()


def error_maps() -> str:
    """$kvserve_dialect from the path, and $kvserve_error_STATUS, the body for it."""
    out = ["map $uri $kvserve_dialect {", *(f"    {rx} {name};" for name, (_, rx) in DIALECTS.items()), "}"]
    for status in ERRORS:
        out.append(f"map $kvserve_dialect $kvserve_error_{status} {{")
        for name, (path, _) in DIALECTS.items():
            body = error_body(status, path)
            assert "'" not in body and "\\" not in body, body  # it is written between single quotes
            out.append(f"    {'default' if name == 'openai' else name} '{body}';")
        out.append("}")
    return "\n    ".join(out)


def error_locations() -> str:
    out = []
    for status in ERRORS:
        retry = f"add_header Retry-After {RETRY_AFTER_S} always;" if status in (502, 503) else ""
        out.append(f"location @kvserve_{status} {{ default_type application/json; {retry} "
                   f"return {status} $kvserve_error_{status}; }}")
    return "\n        ".join(out)


def nginx_binary() -> str | None:
    """nginx's path, or None where it is not installed."""
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    return binary if Path(binary).exists() else None


def nginx_config(work: Path, listen: str, router: str, replicas: list[str], health: str, sessions: bool = True) -> str:
    """The whole nginx.conf: `listen` (HOST:PORT), `router`, each replica and the cluster's `health`
    endpoint as HOST:PORT; with `sessions`, session traffic goes to its replica, else everything to the router."""
    temp = "\n    ".join(f"{kind}_temp_path {work / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    servers = "\n        ".join(f"server {r} max_fails=1 fail_timeout={FAIL_TIMEOUT_S}s;" for r in replicas)
    error_pages = "\n        ".join(f"error_page {s} @kvserve_{s};" for s in ERRORS)
    return f"""# written by kvserve cluster (server/cluster_front.py)
worker_processes 1;
daemon off;
pid {work / "nginx.pid"};
error_log {work / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    {temp}
    {error_maps()}
    map $uri $kvserve_path_session {{
        ~^/v1/sessions/(?<sid>[A-Za-z0-9_-]+) $sid;
        default "";
    }}
    map "$http_x_session_id|$kvserve_path_session" $kvserve_session {{
        ~^(?<h>[^|]+)\\|  $h;
        ~^\\|(?<p>.+)$    $p;
        default          "";
    }}
    map $kvserve_session $kvserve_upstream {{
        ""      kvserve_router;
        default {"kvserve_sessions" if sessions else "kvserve_router"};
    }}
    upstream kvserve_sessions {{
        hash $kvserve_session consistent;
        {servers}
        keepalive 32;
    }}
    upstream kvserve_router {{
        server {router};
        keepalive 32;
    }}
    server {{
        listen {listen};
        client_max_body_size 8m;
        {error_pages}
        {error_locations()}
        # the router's own /health is 503 once any replica is dead: the cluster's says whether any serves
        location = /health {{
            proxy_pass http://{health};
            proxy_connect_timeout 2s;
            proxy_read_timeout 10s;
        }}
        location / {{
            proxy_pass http://$kvserve_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_set_header Host $host;
            proxy_intercept_errors on;  # the router's and replicas' 5xx too (ERRORS)
            # a replica that is down: once on to the next one in the ring. Without `non_idempotent`
            # nginx retries a POST only when it was never sent (the connection failed): one that was
            # sent may have run, and a second run would double a session's turn
            proxy_next_upstream error timeout;
            proxy_next_upstream_tries 2;
            proxy_connect_timeout 2s;
            # token streams (SSE) must not wait in a buffer
            proxy_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def start_nginx(binary: str, work: Path, listen: str, router: str, replicas: list[str], health: str, sessions: bool,
                **popen) -> subprocess.Popen:
    work.mkdir(parents=True, exist_ok=True)
    (work / "nginx.conf").write_text(nginx_config(work, listen, router, replicas, health, sessions))
    return subprocess.Popen([binary, "-c", str(work / "nginx.conf"), "-p", str(work)], **popen)
