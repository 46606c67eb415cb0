import re
import secrets
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from models import load_model
from server.cli import build_parser
from server.cluster import cmd_cluster
from server.config import EngineConfig

from ..live_server import LiveServer, free_port

ROOT = Path(__file__).resolve().parents[2]


def test_compose_parses_and_names_only_real_files():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"server", "locust", "prometheus", "cluster"} <= set(services)
    cluster = services["cluster"]
    assert cluster["profiles"] == ["scale"] and cluster["build"]["args"]["EXTRAS"] == "cluster"
    assert "ARG EXTRAS" in (ROOT / "Dockerfile").read_text()
    # the scale profile's command is one `kvserve cluster` accepts, with nginx in front and a shared disk
    command = cluster["command"]
    assert command[:2] == ["kvserve", "cluster"]
    args = build_parser().parse_args(command[1:])
    assert args.func is cmd_cluster and args.nginx and args.replicas == 3 and "--kv-disk" in args.serve_args
    assert f"{args.port}:{args.port}" in cluster["ports"]
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
        if "build" in svc:
            context = svc["build"]["context"] if isinstance(svc["build"], dict) else svc["build"]
            assert (ROOT / context / "Dockerfile").is_file()
    locust_file = services["locust"]["command"][services["locust"]["command"].index("-f") + 1]
    assert locust_file.startswith("/mnt/bench/") and (ROOT / "bench" / Path(locust_file).name).is_file()
    assert "server:8000" in (ROOT / "deploy/prometheus.yml").read_text()
    assert "include /etc/nginx/kvserve-routing.conf" in (ROOT / "deploy/nginx/nginx.conf").read_text()


def test_dockerfile_command_matches_readme_and_exists():
    text = (ROOT / "Dockerfile").read_text()
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M).group(1)
    argv = yaml.safe_load(cmd)
    assert argv[:2] == ["kvserve", "serve"]
    assert shlex.join(argv) in (ROOT / "README.md").read_text()
    assert "HEALTHCHECK" in text and "/health" in text and "torch==2.13.0" in text
    for path in re.findall(r"^COPY (\S+)", text, re.M):
        assert (ROOT / path).exists(), path
    # the command is one the CLI really accepts
    from server.cli import main

    with pytest.raises(SystemExit) as e:
        main([*argv[1:], "--help"])
    assert e.value.code == 0


@pytest.fixture(scope="module")
def nginx_in_front(tmp_path_factory, tiny_checkpoints):
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(nginx).exists(), "nginx is missing: `make test` installs it (Debian package nginx-light)"
    model = load_model(str(tiny_checkpoints["llama"]))
    a, b = LiveServer(model, EngineConfig(), name="tiny"), LiveServer(model, EngineConfig(), name="tiny")
    work = tmp_path_factory.mktemp("nginx")
    port = free_port()
    routing = (ROOT / "deploy/nginx/kvserve-routing.conf").read_text().replace("listen 8080;", f"listen 127.0.0.1:{port};")
    (work / "routing.conf").write_text(routing)
    (work / "nginx.conf").write_text(f"""
daemon off;
pid {work}/nginx.pid;
error_log {work}/error.log;
worker_processes 1;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {work}/body;
    proxy_temp_path {work}/proxy;
    include {work}/routing.conf;
    upstream kvserve_replicas {{
        hash $kvserve_session_key consistent;
        server 127.0.0.1:{a.port};
        server 127.0.0.1:{b.port};
    }}
}}
""")
    with a, b:
        proc = subprocess.Popen([nginx, "-c", str(work / "nginx.conf"), "-p", str(work)], stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            proc.kill()
            raise RuntimeError(proc.stderr.read())
        yield url, a, b
        proc.terminate()
        proc.wait(timeout=10)


def test_nginx_pins_sessions_to_their_replica(nginx_in_front):
    url, a, b = nginx_in_front
    pinned = {}
    for _ in range(64):  # ids until one lands on each replica
        sid = secrets.token_urlsafe(24)
        r = httpx.post(url + "/v1/sessions", json={}, headers={"X-Session-Id": sid})
        assert r.status_code == 200 and r.json()["id"] == sid
        home = a if any(s.id == sid for s in a.engine.sessions) else b
        if home not in pinned:
            pinned[home] = sid
        if len(pinned) == 2:
            break
    assert set(pinned) == {a, b}
    for home, sid in pinned.items():
        lengths = []
        for turn in range(3):
            r = httpx.post(url + "/generate", headers={"X-Session-Id": sid},
                           json={"inputs": f" turn {turn}", "parameters": {"max_new_tokens": 3}})
            assert r.status_code == 200, r.text
            info = httpx.get(f"{url}/v1/sessions/{sid}").json()
            lengths.append(info["length"])
        assert lengths[0] < lengths[1] < lengths[2]  # history kept on one replica
        other = b if home is a else a
        assert not any(s.id == sid for s in other.engine.sessions)
        assert httpx.get(f"{other.url}/v1/sessions/{sid}").status_code == 404
        assert httpx.delete(f"{url}/v1/sessions/{sid}").status_code == 200
