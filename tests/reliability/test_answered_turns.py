"""A turn a client was answered is on disk: kill -9 right after the answer, and the restarted server
holds the session with that turn, every time; under API keys, a tenant's own prefix comes back from
disk after such a kill too, and no other tenant's."""
import json
import subprocess

import httpx
import pytest

from ..live_server import free_port, metric, start_cli_server, wait_healthy

KILLS = 20


def boot(args: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    return start_cli_server(args, port), f"http://127.0.0.1:{port}"


def kill_9(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.communicate(timeout=90)


@pytest.mark.slow
def test_every_answered_turn_survives_kill_9(tmp_path, tiny_checkpoints):
    args = ["--model", str(tiny_checkpoints["llama"]), "--weights", "f32", "--kv-disk", str(tmp_path / "store")]
    # The next server boots while this one answers: it shares the folder, and takes the session up from
    # disk once the one that held it is dead (the lock goes with the process), as a restart would.
    current, spare = boot(args), boot(args)
    try:
        wait_healthy(current[1], timeout=300, proc=current[0])
        sid = httpx.post(current[1] + "/v1/sessions", json={}).json()["id"]
        history, kept = [], []
        for i in range(KILLS):
            proc, url = current
            history.append({"role": "user", "content": f"Turn {i}: say something."})
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": history, "session_id": sid, "max_tokens": 6, "temperature": 0})
            kill_9(proc)  # the moment the answer is in
            assert r.status_code == 200, r.text
            answered = r.json()
            history.append({"role": "assistant", "content": answered["choices"][0]["message"]["content"]})
            current, spare = spare, None
            wait_healthy(current[1], timeout=300, proc=current[0])
            if i + 1 < KILLS:
                spare = boot(args)
            got = httpx.get(f"{current[1]}/v1/sessions/{sid}")
            assert got.status_code == 200, got.text
            kept.append(got.json()["length"] == answered["usage"]["total_tokens"])
        assert all(kept), f"{kept.count(False)} of {KILLS} answered turns lost: {kept}"
    finally:
        for proc, _ in (p for p in (current, spare) if p is not None):
            if proc.poll() is None:
                kill_9(proc)


def test_a_keyed_tenants_prefix_comes_back_from_disk(tmp_path, tiny_checkpoints):
    args = ["--model", str(tiny_checkpoints["llama"]), "--weights", "f32", "--kv-disk", str(tmp_path / "store"),
            "--api-key", "salted-tenant-a", "--api-key", "salted-tenant-b", "--admin-key", "salted-operator"]
    a, b, ops = ({"Authorization": f"Bearer {k}"} for k in ("salted-tenant-a", "salted-tenant-b", "salted-operator"))
    messages = [{"role": "user", "content": "Tell me about the sea and its tides. " * 12}]
    proc, url = boot(args)
    try:
        wait_healthy(url, timeout=300, proc=proc)
        sid = httpx.post(url + "/v1/sessions", json={}, headers=a).json()["id"]
        r = httpx.post(url + "/v1/chat/completions", headers=a, timeout=120,
                       json={"messages": messages, "session_id": sid, "max_tokens": 4})
        kill_9(proc)  # right after the answer: its full blocks were written before it
        assert r.status_code == 200, r.text
        prompt = r.json()["usage"]["prompt_tokens"]
        assert prompt >= 64
        proc, url = boot(args)
        wait_healthy(url, timeout=300, proc=proc)
        resend = {"messages": messages, "max_tokens": 4}
        other = httpx.post(url + "/v1/chat/completions", headers=b, json=resend, timeout=120)
        assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # never another tenant's
        assert metric(url, "kvserve:kv_disk_hits_total", ops) == 0
        own = httpx.post(url + "/v1/chat/completions", headers=a, json=resend, timeout=120)
        cached = own.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert prompt - 16 <= cached <= prompt, (cached, prompt)  # every full block of its prefix
        assert metric(url, "kvserve:kv_disk_hits_total", ops) * 16 >= cached
    finally:
        if proc.poll() is None:
            kill_9(proc)


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_every_answered_stored_response_survives_kill_9(tmp_path, tiny_checkpoints, stream):
    """A stored response reads back after a kill -9 right after the client read it, just as the client
    read it (its status and output, not in_progress nor cut), each on the chain of the one before."""
    args = ["--model", str(tiny_checkpoints["llama"]), "--weights", "f32", "--kv-disk", str(tmp_path / "store")]
    current, spare = boot(args), boot(args)
    previous = None
    try:
        wait_healthy(current[1], timeout=300, proc=current[0])
        for i in range(4):
            proc, url = current
            body = {"input": f"Turn {i}: say something.", "max_output_tokens": 6, "store": True, "stream": stream,
                    **({"previous_response_id": previous} if previous else {})}
            with httpx.stream("POST", url + "/v1/responses", json=body, timeout=120) as r:
                text = r.read().decode()
            kill_9(proc)  # the moment the answer is in
            assert r.status_code == 200, text
            # streamed: the last event's response, as the SDK reads it
            answered = json.loads(text.rstrip().rsplit("data: ", 1)[1])["response"] if stream else json.loads(text)
            assert answered["status"] in ("completed", "incomplete") and answered["output"], answered
            previous = answered["id"]
            current, spare = spare, None
            wait_healthy(current[1], timeout=300, proc=current[0])
            spare = boot(args)
            got = httpx.get(f"{current[1]}/v1/responses/{previous}", timeout=60)
            assert got.status_code == 200, got.text
            kept = got.json()
            assert (kept["status"], kept["output"]) == (answered["status"], answered["output"]), (i, kept, answered)
    finally:
        for proc, _ in (p for p in (current, spare) if p is not None):
            if proc.poll() is None:
                kill_9(proc)
