"""The disk tier fails per file, never whole: a planted folder or an unwritable record costs its own
session only, and a full disk pauses writes while every session already on it stays reachable, is
restored at a restart, and writing resumes once there is room again."""
import contextlib
import logging
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from models import load_model
from server.config import EngineConfig, ServerConfig

from ..live_server import LiveServer, metric

KEYS, ADMIN = ("disk-tenant-a", "disk-tenant-b"), "disk-operator"
OPERATED = ServerConfig(model_name="tiny", admin_key=ADMIN)


def S(name: str) -> str:
    """A session id (ids are at least 22 characters)."""
    return f"disk-faults-session-{name}"


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoints):
    return load_model(str(tiny_checkpoints["llama"]), weights="f32")


def as_key(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def new_session(url: str, key: str, sid: str) -> None:
    r = httpx.post(url + "/v1/sessions", json={"id": sid}, headers=as_key(key))
    assert r.status_code in (200, 201), r.text


def turn(url: str, key: str, sid: str, words: int = 40) -> None:
    body = {"inputs": "word " * words, "session_id": sid, "parameters": {"max_new_tokens": 4}}
    r = httpx.post(url + "/generate", json=body, headers=as_key(key), timeout=120)
    assert r.status_code == 200, r.text


def snapshot(url: str, key: str, sid: str) -> bool:
    r = httpx.post(f"{url}/v1/sessions/{sid}/snapshot", headers=as_key(key), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["on_disk"]


def length(url: str, key: str, sid: str) -> int:
    r = httpx.get(f"{url}/v1/sessions/{sid}", headers=as_key(key))
    assert r.status_code == 200, r.text
    return r.json()["length"]


def listed(url: str, key: str) -> set[str]:
    return {s["id"] for s in httpx.get(url + "/v1/sessions", headers=as_key(key)).json()["data"]}


def test_a_planted_lock_folder_or_bad_record_costs_its_own_session_only(tmp_path, tiny_model, caplog):
    store = tmp_path / "store"
    config = EngineConfig(kv_dtype="float32", kv_disk=str(store))
    a, b = KEYS
    with caplog.at_level(logging.WARNING, logger="kvserve.disk"), LiveServer(tiny_model, config, api_keys=KEYS, server_config=OPERATED) as server:
        url = server.url
        new_session(url, a, S("first"))
        turn(url, a, S("first"))
        assert snapshot(url, a, S("first"))
        sessions = next(store.glob("*/sessions"))
        owner_a = next(sessions.glob(f"*.{S('first')}.lock")).name.split(".")[0]
        new_session(url, b, S("probe"))
        owner_b = next(sessions.glob(f"*.{S('probe')}.lock")).name.split(".")[0]

        (sessions / f"{owner_a}.{S('victim')}.lock").mkdir()  # as the issue planted it: the lock is a folder
        (sessions / f"{owner_b}.{S('walled')}.json").mkdir()  # and a record that cannot be written
        new_session(url, a, S("victim"))
        turn(url, a, S("victim"))
        new_session(url, b, S("walled"))
        turn(url, b, S("walled"))
        assert not snapshot(url, b, S("walled"))  # its own record failed: it says so
        turn(url, b, S("walled"))  # and it goes on serving from RAM

        for key, sid in ((a, S("first")), (b, S("probe"))):  # every other session still snapshots
            turn(url, key, sid)
            assert snapshot(url, key, sid)
        new_session(url, b, S("later"))
        turn(url, b, S("later"))
        assert snapshot(url, b, S("later"))
        assert metric(url, "kvserve:kv_disk_healthy", as_key(ADMIN)) == 1
        assert metric(url, "kvserve:kv_disk_errors_total", as_key(ADMIN)) >= 2
        assert httpx.get(url + "/v1/status", headers=as_key(ADMIN)).json()["disk"]["healthy"] is True
        firsts = {sid: length(url, key, sid) for key, sid in ((a, S("first")), (b, S("probe")), (b, S("later")))}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert not any("RAM only" in w for w in warnings), warnings
    writes = [w for w in warnings if S("walled") in w and "failed" in w]
    assert len(writes) == 1, warnings  # once, though it failed on every turn

    with LiveServer(tiny_model, config, api_keys=KEYS, server_config=OPERATED) as server:  # a restart finds the others
        assert S("first") in listed(server.url, a) and {S("probe"), S("later")} <= listed(server.url, b)
        for key, sid in ((a, S("first")), (b, S("probe")), (b, S("later"))):
            assert length(server.url, key, sid) == firsts[sid]
        turn(server.url, b, S("later"))
        assert snapshot(server.url, b, S("later"))


@contextlib.contextmanager
def small_disk(path: Path, size: str = "30m"):
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> None:
    """Write one file until the file system has no byte left."""
    with open(path, "wb", buffering=0) as f:
        for chunk in (1 << 20, 4096, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    assert os.statvfs(path.parent).f_bavail == 0


def wait_for(check, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.3)
    return check()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs to fill needs root")
def test_a_full_disk_pauses_writes_keeps_reads_and_recovers(tmp_path, tiny_model):
    a = KEYS[0]
    with small_disk(tmp_path / "disk") as disk:
        store, filler = disk / "store", disk / "filler"
        brief = EngineConfig(kv_dtype="float32", kv_disk=str(store), session_ttl=2)
        with LiveServer(tiny_model, brief, api_keys=KEYS, server_config=OPERATED) as server:
            url = server.url
            saved = {}
            for sid in (S("one"), S("two"), S("three")):
                new_session(url, a, sid)
                turn(url, a, sid)
                assert snapshot(url, a, sid)
                saved[sid] = length(url, a, sid)
            assert wait_for(lambda: not listed(url, a)), "the idle sessions should have left RAM"

            fill(filler)
            new_session(url, a, S("fresh"))
            turn(url, a, S("fresh"))  # its writes meet the full disk
            assert wait_for(lambda: metric(url, "kvserve:kv_disk_writes_paused", as_key(ADMIN)) == 1)
            assert metric(url, "kvserve:kv_disk_healthy", as_key(ADMIN)) == 1
            status = httpx.get(url + "/v1/status", headers=as_key(ADMIN)).json()["disk"]
            assert status["writes_paused"] is True and status["healthy"] is True
            for sid, n in saved.items():  # reads go on: each comes back from disk
                assert length(url, a, sid) == n
            assert not snapshot(url, a, S("fresh"))  # nothing new is written

        roomy = EngineConfig(kv_dtype="float32", kv_disk=str(store), session_ttl=600)
        with LiveServer(tiny_model, roomy, api_keys=KEYS, server_config=OPERATED) as server:  # the disk still full
            url = server.url
            assert os.statvfs(disk).f_bavail == 0
            assert set(saved) <= listed(url, a), "the sessions on the full disk are restored at start"
            for sid, n in saved.items():
                assert length(url, a, sid) == n
            turn(url, a, S("one"))  # served, from RAM and the blocks on disk

            filler.unlink()  # room again: the next write tried after the pause lands
            assert wait_for(lambda: snapshot(url, a, S("one")), timeout=60)
            assert metric(url, "kvserve:kv_disk_writes_paused", as_key(ADMIN)) == 0
            assert httpx.get(url + "/v1/status", headers=as_key(ADMIN)).json()["disk"]["writes_paused"] is False
            grown = length(url, a, S("one"))
        with LiveServer(tiny_model, roomy, api_keys=KEYS, server_config=OPERATED) as server:
            assert length(server.url, a, S("one")) == grown  # the turn after the disk had room is on it
