"""`kvserve cluster --nginx` on a shared --kv-disk, stopped with SIGTERM and started again twice, under load:
every session and every Responses chain goes on, none answered 409, each with its history's KV read
back; and a replica asked for a session or response another holds relays the request to it."""
import asyncio
import re
import secrets

import httpx
import pytest

from .test_cluster import MODEL, user
from .test_cluster_failover import start_cluster, stop_cluster

SESSIONS, CHAINS, LOAD_USERS = 4, 4, 4


async def session_turn(client: httpx.AsyncClient, url: str, sid: str, history: list[dict], run: int) -> tuple[int, dict]:
    """One chat turn on a session, the whole conversation sent -> (status, usage)."""
    # its own words: two sessions with one history would share blocks, and no read from disk would show
    messages = [*history, {"role": "user", "content": f"Session {sid}, run {run}: one more fact about {len(history) + 3}."}]
    r = await client.post(url + "/v1/chat/completions", headers={"X-Session-Id": sid},
                          json={"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
    if r.status_code != 200:
        return r.status_code, {"error": r.text[:300]}
    history[:] = [*messages, r.json()["choices"][0]["message"]]
    return 200, r.json()["usage"]


async def chain_turn(client: httpx.AsyncClient, url: str, chain: list[dict], name: int, run: int) -> tuple[int, dict]:
    """One Responses turn on a chain (no header nginx could route on: the router sends it anywhere)."""
    body = {"model": MODEL, "input": f"Chain {name}, run {run}, turn {len(chain)}: say one more thing.", "max_output_tokens": 8,
            "temperature": 0}
    if chain:
        body["previous_response_id"] = chain[-1]["id"]
    r = await client.post(url + "/v1/responses", json=body)
    if r.status_code != 200:
        return r.status_code, {"error": r.text[:300]}
    chain.append(r.json())
    return 200, r.json()["usage"]


async def phase(url: str, sessions: dict[str, list], chains: list[list], run: int) -> list[tuple[str, int, dict]]:
    """Two turns of every session and chain, beside users' plain chats -> (what, status, usage) per turn; the
    first turn of each run is the one a restart would strand."""
    async with httpx.AsyncClient(timeout=300) as client:
        load = [asyncio.ensure_future(user(client, url, i, 2)) for i in range(LOAD_USERS)]
        out = []
        for _ in range(2):
            turns = [("session " + sid, session_turn(client, url, sid, h, run)) for sid, h in sessions.items()]
            turns += [(f"chain {i}", chain_turn(client, url, c, i, run)) for i, c in enumerate(chains)]
            done = await asyncio.gather(*(t for _, t in turns))
            out += [(what, status, usage) for (what, _), (status, usage) in zip(turns, done)]
        plain = await asyncio.gather(*load)
    return out + [("load", status, {}) for u in plain for _, status in u]


def history_tokens(url: str, sid: str) -> int:
    return httpx.get(f"{url}/v1/sessions/{sid}", timeout=60).json()["length"]


@pytest.mark.slow
def test_a_cluster_restarted_twice_under_load_strands_no_session_and_no_chain(tmp_path):
    serve = ("--kv-disk", str(tmp_path / "kv"))
    sessions: dict[str, list] = {}
    chains: list[list] = [[] for _ in range(CHAINS)]
    logs = []
    for run in range(3):
        proc, url, pids, log = start_cluster(3, "--nginx", serve=serve)
        logs.append(log)
        try:
            if run == 0:
                for _ in range(SESSIONS - 1):  # named by the client, as nginx routes them
                    sid = secrets.token_urlsafe(18)
                    assert httpx.post(url + "/v1/sessions", headers={"X-Session-Id": sid}, json={}).status_code == 200
                    sessions[sid] = []
                # one made through the router: its replica is the router's pick, not where nginx hashes its id
                made = httpx.post(url + "/v1/sessions", json={}, timeout=60)
                assert made.status_code == 200, made.text
                sessions[made.json()["id"]] = []
                before = {}
            else:  # each session's history, asked first through its own replica, which takes it up from disk
                before = {sid: history_tokens(url, sid) for sid in sessions}
            chain_before = {i: c[-1]["usage"]["input_tokens"] for i, c in enumerate(chains) if c}
            turns = asyncio.run(phase(url, sessions, chains, run))
            failed = [(what, status, usage) for what, status, usage in turns if status != 200]
            assert not failed, failed  # no 409, nor any other failure, for sessions, chains or the load
            firsts = {what: usage for what, _, usage in reversed(turns) if what != "load"}  # each one's first turn
            for sid, length in before.items():  # its whole history's KV, every full block, back from disk
                cached = firsts["session " + sid]["prompt_tokens_details"]["cached_tokens"]
                assert length - 16 <= cached <= length, (sid, cached, length)
            for i, length in chain_before.items():  # the previous response's prompt, at least, reused
                cached = firsts[f"chain {i}"]["input_tokens_details"]["cached_tokens"]
                assert cached >= length - 16, (i, cached, length)
            for c in chains:  # every chain is one conversation: each turn continues the one before it
                assert [r["previous_response_id"] for r in c[1:]] == [r["id"] for r in c[:-1]]
        finally:
            stop_cluster(proc)
    assert all(len(h) == 2 * 3 * 2 for h in sessions.values())  # 3 runs x 2 turns, each a question and a reply
    assert all(len(c) == 3 * 2 for c in chains)
    for run, log in enumerate(logs[1:], start=1):  # a restart takes up nothing until a request names it
        restored = re.findall(r"\[replica \d\] .*kv disk \S+: (\d+) sessions restored, (\d+) sessions left on disk, "
                              r"\d+ sessions expired, (\d+) sessions held by another server", open(log).read())
        assert len(restored) == 3, (run, restored)
        assert all(r == "0" and int(left) >= SESSIONS + CHAINS and held == "0" for r, left, held in restored), restored
