"""Records that cannot crash or escape, against a real `kvserve serve` with a key and a disk tier, attacked
as someone who may write in its folder would: a stored response's record edited on disk reads as missing
(a 404, never a 500), a symlink planted for a lock or a record is refused and nothing is created outside
the folder, and every file and folder the tier makes is its owner's alone. The legitimate use beside
each attack still works."""
import hashlib
import json
import os
import signal
import stat
import subprocess
from pathlib import Path

import httpx

from ..live_server import free_port, metric, start_cli_server, wait_healthy

KEY = "keyA"
H, OPS = {"authorization": f"Bearer {KEY}"}, {"authorization": "Bearer key-ops"}  # OPS: the operator's, for /metrics
NS = hashlib.sha256(KEY.encode()).hexdigest()[:32]  # the key's namespace: a record's name starts with it

# each attack on a stored response's meta, as the record on disk holds it
CORRUPTIONS = {
    "response is a string": lambda meta: {**meta, "response": "not a response"},
    "conversation is a number": lambda meta: {**meta, "conversation": 7},
    "meta lacks its fields": lambda meta: {"note": "nothing a response holds"},
    "input out of range": lambda meta: {**meta, "input": [0, 99]},
    "input not ints": lambda meta: {**meta, "input": ["0", 1]},
    "items lack their fields": lambda meta: {**meta, "conversation": [{"type": "message"}], "input": [0, 1]},
}


def serve(model: Path, store: Path, umask: int | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    old = os.umask(umask) if umask is not None else None  # the server inherits it
    try:
        proc = start_cli_server(["--model", str(model), "--api-key", KEY, "--admin-key", "key-ops",
                                  "--kv-disk", str(store)], port)
    finally:
        if old is not None:
            os.umask(old)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=300, proc=proc)
    return proc, url


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)  # its drain puts every write on disk
    out, _ = proc.communicate(timeout=90)
    return out


def respond(client: httpx.Client, **extra) -> httpx.Response:
    return client.post("/v1/responses", json={"input": "Name a color.", "max_output_tokens": 4, **extra})


def record_of(store: Path, session_id: str) -> Path:
    [path] = store.glob(f"*/sessions/{NS}.{session_id}.json")
    return path


def assert_not_found(r: httpx.Response) -> None:
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["type"] == "not_found_error" and "no stored response" in error["message"]


def test_an_edited_response_record_reads_as_missing_and_the_others_still_work(tmp_path, tiny_checkpoints):
    store = tmp_path / "kv"
    proc, url = serve(tiny_checkpoints["llama"], store)
    try:
        with httpx.Client(base_url=url, headers=H, timeout=120) as client:
            ids = {}
            for name in [*CORRUPTIONS, "untouched"]:
                r = respond(client)
                assert r.status_code == 200, r.text
                ids[name] = r.json()["id"]
    finally:
        stop(proc)
    for name, corrupt in CORRUPTIONS.items():
        path = record_of(store, ids[name])
        record = json.loads(path.read_text())
        path.write_text(json.dumps({**record, "meta": corrupt(record["meta"])}))

    proc, url = serve(tiny_checkpoints["llama"], store)
    try:
        with httpx.Client(base_url=url, headers=H, timeout=120) as client:  # one keep-alive connection for all
            for name in CORRUPTIONS:
                rid = ids[name]
                for _ in range(2):  # and again, once its warning is given
                    assert_not_found(client.get(f"/v1/responses/{rid}"))
                    assert_not_found(client.get(f"/v1/responses/{rid}/input_items"))
                    assert_not_found(respond(client, previous_response_id=rid))
            rid = ids["untouched"]
            assert client.get(f"/v1/responses/{rid}").json()["id"] == rid
            [item] = client.get(f"/v1/responses/{rid}/input_items").json()["data"]
            assert item["content"][0]["text"] == "Name a color."
            r = respond(client, previous_response_id=rid)
            assert r.status_code == 200 and r.json()["previous_response_id"] == rid, r.text
    finally:
        out = stop(proc)
    assert "Traceback" not in out and "unhandled error" not in out, out
    for name in CORRUPTIONS:
        assert out.count(f"stored response {ids[name]!r}: its record does not hold a stored response") == 1, (name, out)


def test_symlinks_planted_for_a_lock_or_a_record_are_refused(tmp_path, tiny_checkpoints):
    store, outside = tmp_path / "kv", tmp_path / "outside"
    outside.mkdir()
    proc, url = serve(tiny_checkpoints["llama"], store)
    try:
        held, hidden = (httpx.post(url + "/v1/sessions", json={}, headers=H).json()["id"] for _ in range(2))
    finally:
        stop(proc)
    sessions = record_of(store, held).parent
    (sessions / f"{NS}.{held}.lock").unlink()
    (sessions / f"{NS}.{held}.lock").symlink_to(outside / "held.lock")
    planted = record_of(store, hidden).read_bytes()
    (outside / "hidden.json").write_bytes(planted)  # a valid record, outside
    (sessions / f"{NS}.{hidden}.json").unlink()
    (sessions / f"{NS}.{hidden}.json").symlink_to(outside / "hidden.json")
    chosen = "a-session-id-chosen-by-its-client"
    (sessions / f"{NS}.{chosen}.lock").symlink_to(outside / "chosen.lock")

    proc, url = serve(tiny_checkpoints["llama"], store)  # it tries to claim every session it finds
    try:
        for _ in range(2):  # a request for it tries again
            assert httpx.get(f"{url}/v1/sessions/{held}", headers=H).status_code == 409
        assert httpx.get(f"{url}/v1/sessions/{hidden}", headers=H).status_code == 404
        assert hidden not in {s["id"] for s in httpx.get(url + "/v1/sessions", headers=H).json()["data"]}
        assert metric(url, "kvserve:kv_disk_errors_total", OPS) >= 2
        # a new session under a planted lock: made, and served from RAM, the lock still refused
        assert httpx.post(url + "/v1/sessions", json={"id": chosen}, headers=H).status_code == 200
        turn = {"inputs": "word " * 40, "session_id": chosen, "parameters": {"max_new_tokens": 4}}
        assert httpx.post(url + "/generate", json=turn, headers=H, timeout=120).status_code == 200
        assert httpx.post(url + "/generate", json={"inputs": "Hello", "parameters": {"max_new_tokens": 4}},
                          headers=H, timeout=120).status_code == 200
        assert metric(url, "kvserve:kv_disk_healthy", OPS) == 1
    finally:
        out = stop(proc)
    assert sorted(p.name for p in outside.iterdir()) == ["hidden.json"], "nothing is created outside the folder"
    assert (outside / "hidden.json").read_bytes() == planted
    for key in (held, chosen):
        assert out.count(f"lock of session {NS}.{key} refused") == 1, out
    assert f"session record {NS}.{hidden}.json refused" in out
    assert "Traceback" not in out, out


def test_every_file_is_0600_and_every_folder_0700(tmp_path, tiny_checkpoints):
    store = tmp_path / "made" / "by" / "the-server"
    proc, url = serve(tiny_checkpoints["llama"], store, umask=0)  # no umask to narrow what the server asks for
    try:
        with httpx.Client(base_url=url, headers=H, timeout=120) as client:
            sid = client.post("/v1/sessions", json={}).json()["id"]
            turn = {"inputs": "word " * 60, "session_id": sid, "parameters": {"max_new_tokens": 4}}
            assert client.post("/generate", json=turn).status_code == 200
            assert respond(client).status_code == 200
            assert client.post(f"/v1/sessions/{sid}/snapshot").json()["on_disk"] is True
            held = {p: stat.S_IMODE(p.lstat().st_mode) for p in [store, *store.rglob("*")]}  # locks held, too
    finally:
        stop(proc)
    assert {p.suffix for p in held} >= {".json", ".lock"} and any(p.parent.parent.name == "blocks" for p in held)
    assert {p.relative_to(tmp_path): oct(m) for p, m in held.items() if p.is_file() and m != 0o600} == {}
    assert {p.relative_to(tmp_path): oct(m) for p, m in held.items() if p.is_dir() and m != 0o700} == {}
    assert all(p.is_file() or p.is_dir() for p in held)
    for folder in (tmp_path / "made", tmp_path / "made" / "by"):  # made on the way to the folder: its owner's too
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
