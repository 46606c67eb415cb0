"""Sessions that nothing loses: the disk tier under the pool (--kv-disk), across kill -9 and SIGTERM,
with bad files, another model's store, and a disk budget too small to hold anything."""
import signal
import subprocess
import time

import httpx
import pytest

from server.config import EngineConfig

from ..live_server import LiveServer, free_port, metric, start_cli_server, wait_healthy

# f32: the restarted server recomputes the history's last partial block as a prefill chunk where the
# server that never died decoded it token by token; exact weights keep greedy tokens equal across shapes
WEIGHTS = ["--weights", "f32", "--kv-dtype", "float32"]
QUESTIONS = ["Name a color.", "Name a fruit.", "Name an animal.", "Now name a country."]


def chat(url: str, sid: str, history: list[dict], question: str) -> dict:
    history.append({"role": "user", "content": question})
    r = httpx.post(url + "/v1/chat/completions", json={"messages": history, "session_id": sid, "max_tokens": 20,
                                                       "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    history.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return body


def serve(store, *extra) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_cli_server([*WEIGHTS, "--kv-disk", str(store), *extra], port)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, timeout=300, proc=proc)
    return proc, url


def stop(proc: subprocess.Popen, sig=signal.SIGKILL) -> str:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=90)
    return out


def reference(smollm) -> list[dict]:
    """The four turns on a server that never died (the same f32 weights and KV, in process)."""
    with LiveServer(smollm, EngineConfig(kv_dtype="float32")) as ref:
        sid, history = httpx.post(ref.url + "/v1/sessions", json={}).json()["id"], []
        replies = [chat(ref.url, sid, history, q) for q in QUESTIONS]
    return replies


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["kill-9", "sigterm"])
def test_a_session_survives_its_server(tmp_path, smollm, sig):
    want = reference(smollm)
    proc, url = serve(tmp_path / "store")
    try:
        sid, history = httpx.post(url + "/v1/sessions", json={}).json()["id"], []
        for q in QUESTIONS[:3]:
            chat(url, sid, history, q)
        if sig == signal.SIGKILL:  # no snapshot: the write-behind gets the turns to disk by itself
            deadline = time.monotonic() + 60
            while httpx.get(url + "/v1/status").json()["disk"]["pending_writes"] and time.monotonic() < deadline:
                time.sleep(0.05)
        length = httpx.get(f"{url}/v1/sessions/{sid}").json()["length"]
    finally:
        out = stop(proc, sig)
    assert sig == signal.SIGKILL or proc.returncode == 0, out
    proc, url = serve(tmp_path / "store")
    try:
        listed = httpx.get(url + "/v1/sessions").json()["data"]
        assert [(s["id"], s["length"], s["resident"]) for s in listed] == [(sid, length, False)]
        got = chat(url, sid, history, QUESTIONS[3])
        cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert length - 16 <= cached <= length, (cached, length)  # all but the partial last block came from disk
        assert got["choices"][0]["message"]["content"] == want[3]["choices"][0]["message"]["content"]
        assert metric(url, "kvserve:kv_disk_hits_total") * 16 >= length - 16
    finally:
        stop(proc, signal.SIGTERM)


def test_a_damaged_store_is_recomputed_never_served(tmp_path, smollm):
    want = reference(smollm)
    store = tmp_path / "store"
    proc, url = serve(store)
    try:
        sid, history = httpx.post(url + "/v1/sessions", json={}).json()["id"], []
        other = httpx.post(url + "/v1/sessions", json={}).json()["id"]
        for q in QUESTIONS[:3]:
            chat(url, sid, history, q)
        chat(url, other, [], QUESTIONS[0])
    finally:
        stop(proc, signal.SIGTERM)
    files = [p for p in store.rglob("*") if p.is_file() and p.name != "manifest.json" and p.stat().st_size]  # (locks are empty)
    assert len(files) > 5
    for path in files:  # flip bytes in every block file and record
        data = bytearray(path.read_bytes())
        for at in (len(data) // 2, len(data) - 1, 0):
            data[at] ^= 0x5A
        path.write_bytes(bytes(data))
    proc, url = serve(store)
    try:
        listed = {s["id"] for s in httpx.get(url + "/v1/sessions").json()["data"]}
        assert listed == set(), "a record that fails to parse must be skipped"
        fresh = httpx.post(url + "/v1/sessions", json={}).json()["id"]
        history = []
        replies = [chat(url, fresh, history, q) for q in QUESTIONS]
        assert [r["choices"][0]["message"]["content"] for r in replies] == [r["choices"][0]["message"]["content"] for r in want]
        assert metric(url, "kvserve:kv_disk_hits_total") == 0  # every damaged block failed its check, none was served
        assert metric(url, "kvserve:kv_disk_errors_total") > 0
    finally:
        out = stop(proc, signal.SIGTERM)
    assert "failed its checks" in out or "does not parse" in out


def test_another_models_store_is_never_reused(tmp_path, tiny_checkpoints):
    store = tmp_path / "store"
    port = free_port()
    model = ["--model", str(tiny_checkpoints["llama"])]
    for weights, expect_cached in (("q4", None), ("f16", 0)):  # an f16 server on a q4 store
        proc = start_cli_server([*model, "--weights", weights, "--kv-disk", str(store)], port)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, timeout=300, proc=proc)
            if expect_cached is not None:
                assert httpx.get(url + "/v1/sessions").json()["data"] == []
            sid = "shared-session-id-for-both-models"
            if expect_cached is None:
                httpx.post(url + "/v1/sessions", json={"id": sid})
                prompt = {"inputs": "word " * 60, "session_id": sid, "parameters": {"max_new_tokens": 4}}
                assert httpx.post(url + "/generate", json=prompt, timeout=60).status_code == 200
            else:
                r = httpx.post(url + "/v1/completions", json={"prompt": "word " * 60, "max_tokens": 4}, timeout=60)
                assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert metric(url, "kvserve:kv_disk_hits_total") == 0
        finally:
            out = stop(proc, signal.SIGTERM)
    assert "other model identities" in out


def test_a_disk_budget_too_small_for_one_block_still_serves(tmp_path, tiny_checkpoints):
    port = free_port()
    proc = start_cli_server(["--model", str(tiny_checkpoints["llama"]), "--kv-disk", str(tmp_path / "store"),
                             "--kv-disk-budget", "100"], port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=300, proc=proc)
        sid = httpx.post(url + "/v1/sessions", json={}).json()["id"]
        for _ in range(3):  # a persistent session's blocks are written behind: none fits in 100 bytes
            body = {"inputs": "word " * 60, "session_id": sid, "parameters": {"max_new_tokens": 4}}
            assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 200
        assert httpx.post(f"{url}/v1/sessions/{sid}/snapshot").status_code == 200
        status = httpx.get(url + "/v1/status").json()["disk"]
        assert status["bytes"] <= status["budget"] and status["blocks"] == 0
    finally:
        stop(proc, signal.SIGTERM)


def test_a_store_that_cannot_be_a_folder_degrades_to_ram(tmp_path, tiny_checkpoints):
    (tmp_path / "a-file").write_text("not a folder")
    port = free_port()
    proc = start_cli_server(["--model", str(tiny_checkpoints["llama"]), "--kv-disk", str(tmp_path / "a-file" / "store")], port)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=300, proc=proc)
        r = httpx.post(url + "/generate", json={"inputs": "word " * 60, "parameters": {"max_new_tokens": 4}}, timeout=60)
        assert r.status_code == 200
        assert metric(url, "kvserve:kv_disk_healthy") == 0 and metric(url, "kvserve:kv_disk_errors_total") >= 1
    finally:
        out = stop(proc, signal.SIGTERM)
    assert "serving goes on from RAM only" in out


def test_a_session_moves_to_the_server_beside_it_when_its_own_dies(tmp_path, tiny_checkpoints):
    """Both servers share the folder from the start: the blocks the first writes after the second came up
    are found by the second all the same."""
    store, model = tmp_path / "store", ["--model", str(tiny_checkpoints["llama"]), "--weights", "f32"]
    first_port, second_port = free_port(), free_port()
    first = start_cli_server([*model, "--kv-disk", str(store)], first_port)
    second = start_cli_server([*model, "--kv-disk", str(store)], second_port)
    try:
        a, b = f"http://127.0.0.1:{first_port}", f"http://127.0.0.1:{second_port}"
        wait_healthy(a, timeout=300, proc=first)
        wait_healthy(b, timeout=300, proc=second)
        sid = httpx.post(a + "/v1/sessions", json={}).json()["id"]
        for words in (60, 30):
            body = {"inputs": "word " * words, "session_id": sid, "parameters": {"max_new_tokens": 4}}
            assert httpx.post(a + "/generate", json=body, timeout=60).status_code == 200
        assert httpx.post(f"{a}/v1/sessions/{sid}/snapshot").json()["on_disk"] is True
        length = httpx.get(f"{a}/v1/sessions/{sid}").json()["length"]

        turn = {"inputs": " more", "session_id": sid, "parameters": {"max_new_tokens": 4, "details": True}}
        held = httpx.post(b + "/generate", json=turn, timeout=60)
        assert held.status_code == 409 and "another server" in held.json()["error"]["message"]

        stop(first, signal.SIGKILL)  # the kernel drops its claim with it
        taken = httpx.post(b + "/generate", json=turn, timeout=60)
        assert taken.status_code == 200, taken.text
        grown = httpx.get(f"{b}/v1/sessions/{sid}").json()["length"] - length  # it continued the history it took over
        assert 1 + taken.json()["details"]["generated_tokens"] <= grown <= 3 + taken.json()["details"]["generated_tokens"]
        assert metric(b, "kvserve:kv_disk_hits_total") >= (length - 16) // 16
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                stop(proc, signal.SIGTERM)


def test_sessions_spill_to_disk_and_come_back_with_the_same_replies(tmp_path, smollm):
    def turns(url: str) -> list[list[int]]:
        sids = [httpx.post(url + "/v1/sessions", json={}).json()["id"] for _ in range(6)]
        out = []
        for turn in range(3):
            for i, sid in enumerate(sids):
                body = {"inputs": f" Session {i}, turn {turn}: " + "tell me more " * 30, "session_id": sid,
                        "parameters": {"max_new_tokens": 8, "details": True}}
                r = httpx.post(url + "/generate", json=body, timeout=120)
                assert r.status_code == 200, r.text
                out.append([t["id"] for t in r.json()["details"]["tokens"]])
        return out

    with LiveServer(smollm, EngineConfig(kv_dtype="float32")) as roomy:
        block_bytes = roomy.engine.pool.blocks.block_bytes
        want = turns(roomy.url)
    tight = EngineConfig(kv_dtype="float32", kv_budget=48 * block_bytes, kv_disk=str(tmp_path / "store"))
    with LiveServer(smollm, tight) as server:  # 768 tokens of KV: two sessions' histories
        assert turns(server.url) == want
        assert metric(server.url, "kvserve:kv_disk_hits_total") > 0
        assert metric(server.url, "kvserve:num_session_evictions_total") > 0
        server.engine.pool.blocks.check()
